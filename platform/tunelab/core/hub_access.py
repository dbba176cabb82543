"""The Hugging Face hub as a service a cell may need: every request bounded in time, and a hub that cannot be
reached found out once, quickly, and said plainly, instead of hanging or retrying file by file.

Why: huggingface_hub 2.x sends some requests without any timeout (`repo_info` passes timeout=None, which
overrides its client's default), so a hub address that accepts connections and never answers (a dead proxy,
a firewall that drops) hangs a cell forever; and it retries each request 5 times with sleeps of up to 8 s,
so even a refused connection costs close to a minute per file a model needs. Here (once per process, before
the first hub access): one probe of the endpoint within `TUNELAB_HUB_TIMEOUT` seconds; when it gets no answer
the process goes offline (files already in the local cache still load, anything else fails at once, saying
the hub was unreachable); when it answers, each request gets a timeout of that many seconds (connect, and
between bytes read) where the library gave none.
"""

from __future__ import annotations

import functools
import os
import sys
import urllib.error
import urllib.request

from tunelab.core.errors import env_number

TIMEOUT_ENV = "TUNELAB_HUB_TIMEOUT"
DEFAULT_TIMEOUT_S = 10.0
_TRUE = {"1", "TRUE", "YES", "ON"}


def hub_timeout() -> float:
    return env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, what="seconds, a number")


def check_env() -> None:
    """Before a matrix runs: the settings this module reads from the environment are usable."""
    hub_timeout()


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or "").upper() in _TRUE


def cached_hub_file(repo: str, filename: str, revision: str | None = None) -> str | None:
    """The local path of a hub repo's file when the Hugging Face cache holds it, else None; asks no server."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo, filename, revision=revision)
    return found if isinstance(found, str) else None


def unreachable(url: str, timeout: float) -> str | None:
    """Why `url` cannot be reached within `timeout` s, or None when anything answers (an HTTP error status is
    an answer: the server is there)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return f"no answer within {timeout:g} s" if "timed out" in str(reason) else str(reason)
    return None


@functools.cache
def prepare_hub() -> str | None:
    """Call before the first hub access of a process (idempotent). Returns what was found when the hub is
    unreachable (also printed to stderr, i.e. the cell's log), else None."""
    if offline():
        return None
    _bound_requests(hub_timeout())
    reason = unreachable(endpoint(), hub_timeout())
    if reason is None:
        return None
    _go_offline()
    note = (f"the Hugging Face hub at {endpoint()} is unreachable ({reason}): working offline, with files already "
            f"in the local cache only (set HF_ENDPOINT or a proxy if the hub is elsewhere; {TIMEOUT_ENV} sets "
            f"the wait)")
    print(f"tunelab: {note}", file=sys.stderr, flush=True)
    return note


def _go_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"  # for libraries imported from now on, and child processes
    for module, attr in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                         ("datasets.config", "HF_DATASETS_OFFLINE")):
        if module in sys.modules and hasattr(sys.modules[module], attr):  # already read the environment
            setattr(sys.modules[module], attr, True)


def _bound_requests(seconds: float) -> None:
    """Give every hub request a timeout where none was set (the request's own values win otherwise)."""
    try:
        import huggingface_hub
        from huggingface_hub.utils._http import default_client_factory
    except ImportError:  # another version: its own timeouts apply
        return

    def bound(request) -> None:
        given = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {k: given.get(k) or seconds for k in ("connect", "read", "write", "pool")}

    def factory():
        client = default_client_factory()
        client.event_hooks["request"] = [*client.event_hooks["request"], bound]
        return client

    huggingface_hub.set_client_factory(factory)
