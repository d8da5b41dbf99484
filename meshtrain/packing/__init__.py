"""Packed sequences: several documents in one window, attention and targets kept inside each."""

from meshtrain.packing.documents import (
    cut_targets, document_block_mask, document_ids, document_mask, document_positions,
    documents_block_mask, eos_documents,
)

__all__ = ["cut_targets", "document_block_mask", "document_ids", "document_mask",
           "document_positions", "documents_block_mask", "eos_documents"]
