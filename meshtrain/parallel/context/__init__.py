"""Context parallelism: each sequence split over ranks, attention over all-gathered keys and
values."""
