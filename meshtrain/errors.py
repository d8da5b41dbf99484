"""Error types. User mistakes raise a `ConfigError` (a `ValueError`) that says what is wrong and
how to fix it; `assert` is kept for internal invariants."""


class MeshtrainError(Exception):
    """Base class of every error meshtrain raises on purpose."""


class ConfigError(MeshtrainError, ValueError):
    """A bad setting or input from the user, found before any process group is created."""


class LayoutError(ConfigError):
    """A layout string or object that cannot describe a mesh for this world size."""


class WorkerFailed(MeshtrainError, RuntimeError):
    """A worker process of a job exited with an error; the whole job was stopped."""


class CollectiveMismatch(MeshtrainError, RuntimeError):
    """Ranks were about to run different collectives (or one never joined); names the ranks and
    each one's call site. ``ranks`` holds the ranks that disagree or are missing."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)
