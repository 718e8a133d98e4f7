"""How a failed hub request is reported: unreachable (network, 5xx) or refused (gated, missing).

Shared by the safetensors checkpoint download (:mod:`cachesvc.cache.checkpoints`) and the GGUF one
(:mod:`cachesvc.cache.gguf_checkpoints`), so both give the same errors and hints.
"""

from __future__ import annotations

from cachesvc.errors import CheckpointError, HubUnreachableError


def at_revision(revision: str | None) -> str:
    return "" if revision is None else f" (revision {revision!r})"


def unreachable(model: str, cause: BaseException) -> HubUnreachableError:
    return HubUnreachableError(
        f"cannot reach the Hugging Face hub to fetch {model} ({type(cause).__name__}: {cause}) and it is "
        "not in the local cache; check the network (HF_ENDPOINT, proxy), pass a local checkpoint directory, "
        "or pre-populate the cache"
    )


def hub_refused(model: str, revision: str | None, exc: Exception) -> CheckpointError:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, GatedRepoError):
        what = "is gated; accept its terms on the hub and log in (HF_TOKEN or `hf auth login`)"
    elif isinstance(exc, RevisionNotFoundError):
        what = f"has no revision {revision!r}; pass an existing branch, tag or commit"
    elif isinstance(exc, RepositoryNotFoundError):
        what = "was not found on the hub (or is private); check the id, or log in if it is private"
    elif isinstance(exc, HfHubHTTPError):
        what = "could not be fetched from the hub"
    else:
        what = "could not be downloaded"
    return CheckpointError(f"{model}{at_revision(revision)} {what} (hub said: {reason})")


def is_server_error(exc: BaseException) -> bool:
    """A 5xx from the hub: it is down, which for us is the same as unreachable."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return isinstance(status, int) and status >= 500


def is_connection_error(exc: BaseException | None) -> bool:
    # huggingface_hub has changed HTTP clients across versions (requests, httpx, httpx2), so
    # match the transport error family by class name rather than import each client.
    if exc is None:
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & _TRANSPORT_ERROR_NAMES)


_TRANSPORT_ERROR_NAMES = frozenset(
    {
        "ConnectError",
        "ConnectTimeout",
        "TimeoutException",
        "NetworkError",
        "TransportError",
        "ProxyError",
        "ConnectionError",
        "Timeout",
    }
)
