"""The few exception types cachemgr raises; the CLI and HTTP edges turn them into messages."""


class CachemgrError(Exception):
    """Base class: a failure with a one-line, user-facing message."""

    exit_code = 1
    http_status = 500
    title = "cachemgr error"


class ConfigError(CachemgrError):
    """Bad settings or arguments: a field, a value, a path that cannot be used."""

    exit_code = 2
    http_status = 400
    title = "invalid configuration"


class BadRequestError(CachemgrError):
    """An HTTP request that is well-formed but says nothing clear (a purge that chooses no
    namespace, or contradicts itself): refused before anything is done."""

    exit_code = 2
    http_status = 400
    title = "bad request"


class PortInUseError(ConfigError):
    """The HTTP port is taken (by a cachemgr daemon or another program)."""


class RootNotWritable(CachemgrError):
    """The cache root cannot be written (a read-only mount, permissions): nothing was changed.

    Not the request's fault, nor a setting's: the server cannot do it now (HTTP 503)."""

    exit_code = 2
    http_status = 503
    title = "cache root not writable"


class IndexSettling(CachemgrError):
    """The daemon's GC has not started: its index has not matched the disk since the start, or
    GC's model of the pages is still loading. A run now would plan from rows that may be stale
    or without an order. Ask again once /readyz no longer says so (HTTP 503)."""

    exit_code = 2
    http_status = 503
    title = "index still settling"


class StateError(CachemgrError):
    """The state database cannot be used (newer than this code, corrupt, failed migration)."""

    exit_code = 2
    http_status = 500
    title = "state database error"


class StateDiskFull(StateError):
    """The state DB's filesystem is full; the CLI says the fix that fits where the root is."""


class StateCorrupt(StateError):
    """The state DB was found corrupt and moved aside; the next use rebuilds it from disk."""

    http_status = 503
    title = "state database corrupt, being rebuilt"


class IdentityError(CachemgrError):
    """The identity cannot be computed (missing model, unreadable or changing file)."""

    exit_code = 2
    http_status = 422
    title = "identity error"


class NotFoundError(CachemgrError):
    """A namespace, instance or file that was asked for does not exist."""

    exit_code = 1
    http_status = 404
    title = "not found"


class ModelNotFoundError(NotFoundError, IdentityError):
    """The model the identity needs is not there: not found (exit 1), and an identity error."""

    title = "model not found"


class UnsafePathError(CachemgrError):
    """A path would leave the root or cross a symlink; nothing was touched.

    Over HTTP it is the root's state, not the request's (a request names namespaces by a
    checked id, never a path): a 503 as RootNotWritable, for a person to fix on the host."""

    exit_code = 2
    http_status = 503
    title = "unsafe path in the cache root"


class LimitNotHeld(CachemgrError):
    """A GC run could not delete what a cap or the free-space floor needed (refusals)."""

    exit_code = 1


class ConflictError(CachemgrError):
    """Another process holds what this operation needs (a lock, a running purge)."""

    exit_code = 1
    http_status = 409
    title = "conflict"


class StateLocked(StateError):
    """Another connection held the state DB's write lock for longer than this write could
    wait; nothing was written (and nothing it would have recorded was done)."""

    exit_code = 1
    http_status = 503
    title = "state database locked"


class StateUnavailable(StateError):
    """The state dir is there but this process may not use it (mode bits, an ACL, another
    owner); nothing was read or written. It is retried: usable again once its mode is fixed."""

    exit_code = 2
    http_status = 503
    title = "state directory unavailable"
