"""NIXL agents as the `nixl` KV transport uses them (nixl_sender.py, nixl_receiver.py): which NIXL
package is installed, an agent over UCX, memory registration and what its failure means.

NIXL (NVIDIA's inference transfer library; PyPI `nixl-cu12` / `nixl-cu13`, UCX inside) is the
optional extra `pdserve[nixl]` (`make venv` installs it on x86-64 Linux). Without it `nixl` is
refused in one line naming the extra (`nixl_unavailable`).

Two settings differ from the Python API's defaults, both measured on a 2-core host (docs/disaggregation.md,
"NIXL"):
- The progress thread: a prefill rank's agent must progress UCX for reads of its memory to be
  served over TCP (without one a read stalls); the API starts it with a 0 us delay, a spinning core
  (80-90% of one, idle). pdserve's waits PROGRESS_DELAY_US between passes: 3% of a core idle, the
  same read rate. A decode rank's agent (it only reads) has none: its waits progress it.
- Thread safety: an agent is called from several connection threads, so it locks (STRICT).
"""
from __future__ import annotations

import importlib
import logging
import os
import resource
import uuid

import torch

logger = logging.getLogger(__name__)
EXTRA = "pip install 'pdserve[nixl]'"
MODULES = ("nixl", "nixl_cu13", "nixl_cu12")  # the meta package (picks a CUDA build), else either build
PROGRESS_DELAY_US = 100  # between the progress thread's passes (module docstring)


class NixlError(RuntimeError):
    """NIXL is missing, or an agent or a registration failed; the message says what to do."""


def _module():
    """The installed NIXL package's API module (MODULES, in order), or NixlError naming the extra.

    NIXL's import configures its "nixl" logger to print to stdout, not to propagate, and turns off
    `logging.raiseExceptions` for the process: its records go through this process's logging
    instead (stderr; stdout may carry a command's JSON), and the flag is put back."""
    errors, raise_exceptions = [], logging.raiseExceptions
    for name in MODULES:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        except Exception as exc:  # a build whose shared libraries do not load here
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        finally:
            logging.raiseExceptions = raise_exceptions
        nixl_logger = logging.getLogger("nixl")
        nixl_logger.handlers.clear()
        nixl_logger.propagate = True
        return api
    raise NixlError(f"kv_transport nixl needs the NIXL package ({EXTRA}); {errors[-1]}")


def nixl_unavailable() -> str | None:
    """Why the nixl transport cannot run here (None: it can)."""
    try:
        _module()
    except NixlError as exc:
        return str(exc)
    return None


def make_agent(role: str, progress: bool):
    """A NIXL agent over UCX named uniquely (`role`, this process, a random part), with a progress
    thread (`progress`: whose memory others read) that waits PROGRESS_DELAY_US between passes."""
    api = _module()
    config_class = api.nixlBind.nixlAgentConfig

    class DelayedProgress(config_class):  # the API writes pthrDelay = 0 into the config it builds
        def __setattr__(self, key, value):
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    name = f"pdserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    config = api.nixl_agent_config(enable_prog_thread=progress, backends=["UCX"],
                                   sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    api.nixlBind.nixlAgentConfig = DelayedProgress
    try:
        agent = api.nixl_agent(name, config)
    except Exception as exc:
        raise NixlError(f"NIXL agent over UCX could not start: {type(exc).__name__}: {str(exc)[:200]}") from None
    finally:
        api.nixlBind.nixlAgentConfig = config_class
    if "UCX" not in agent.backends:
        raise NixlError("NIXL has no UCX backend here (its UCX plugin did not load)")
    return agent


def register(agent, tensor: torch.Tensor):
    """Registers `tensor`'s memory with `agent` (host or device memory, as it lies); NixlError when
    it fails, naming the locked-memory limit, which a registration that pins pages needs."""
    try:
        return agent.register_memory(tensor)
    except Exception as exc:
        raise NixlError(f"registering {tensor.nbytes / 2**20:.0f} MiB of {tensor.device.type} memory with NIXL failed "
                        f"({type(exc).__name__}: {str(exc)[:160]}); {memlock_hint(tensor.nbytes)}") from None


def memlock_hint(nbytes: int) -> str:
    """What the locked-memory limit is and must be for `nbytes` to be pinned."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    have = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"
    return (f"RDMA transports pin what they register: `ulimit -l` is {have} here and must be at least "
            f"{-(-nbytes >> 10)} KiB, or unlimited (in a pod: the container's memlock limit, or IPC_LOCK)")


def mem_type(tensor: torch.Tensor) -> str:
    """NIXL's name of the memory `tensor` lies in."""
    return "VRAM" if tensor.is_cuda else "DRAM"
