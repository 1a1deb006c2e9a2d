"""One exception type per kind of user mistake; each message names the culprit and the fix."""


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class MeshError(AutoparError):
    """The mesh does not fit the job (axis names, sizes, world size, device profile)."""


class CaptureError(AutoparError):
    """The model could not be traced into a graph."""


class ShardingError(AutoparError):
    """A requested placement is impossible (e.g. a dimension that the mesh axis cannot split)."""


class InfeasibleError(AutoparError):
    """No plan fits the memory budget; `min_memory_bytes` is the smallest budget that would."""

    def __init__(self, message: str, min_memory_bytes: float | None = None):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes

    def __reduce__(self):      # pickled whole (rank 0 sends it to every rank)
        return type(self), (str(self), self.min_memory_bytes)


class PlanMismatchError(AutoparError):
    """A saved plan does not belong to this model, inputs or mesh."""


class PlanOptionError(AutoparError, ValueError):
    """A planning option has a value autopar does not know, or one the mesh cannot serve
    (e.g. offload to a tier the device profile does not have)."""
class PlanFileError(AutoparError):
    """A plan or plan-cache file (or plan dict) that is not a valid plan: unreadable, not JSON, a field
    missing, of the wrong type or out of range, an expression outside the cost grammar. The message
    names the file and the field; nothing in the file is ever evaluated."""


class CollectiveError(AutoparError):
    """A collective failed or timed out because a rank died or hangs; the message names the ranks
    that never reached it and what the collective was (`autoparallelize(collective_timeout=...)`)."""


class CheckpointError(AutoparError):
    """A checkpoint (a Hugging Face safetensors directory or a torch.distributed.checkpoint directory)
    that does not fit the model: a tensor missing, unexpected or of another shape, a file truncated or
    unreadable. The message names the file and the key; raised on every rank before any parameter is
    assigned. Also an `init=` that cannot make the model's values (it writes outside its module)."""
