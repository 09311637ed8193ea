"""How fast a healing replica group reads a peer's state, by transport: ``python -m bench.heal_transfer``.

Two processes, a serving rank and a healing one, as one rank of each of two replica groups: the server offers a
state of ``--mb`` megabytes (float32 tensors of 4 MB, as a model's and optimizer's shards), the healer fetches it,
through

- **http**: the trainer's transport (``examples.ft_transport.PeerTransport``: torchft's HTTP transport serving a
  snapshot), what ``examples/ft.py`` uses on every device;
- **pg**: torchft's ``PGTransport`` over a gloo process group between the two (on a GPU it would be NCCL's);

in turns A B B A (``--rounds``), each healer's read timed from its request to the state in hand. Printed: each
read's seconds and MB/s, the medians, and last ``heal_transfer_http_over_pg_ratio=<median http s / median pg s>``.
CPU only here: a GPU's PGTransport moves device memory over NCCL with no host copy, which this does not measure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

import torch

TENSOR_BYTES = 4 << 20
ORDER = ("http", "pg")


def state(mb: int) -> dict[str, torch.Tensor]:
    n = max(1, (mb << 20) // TENSOR_BYTES)
    return {f"t{i}": torch.full((TENSOR_BYTES // 4,), float(i)) for i in range(n)}


def rounds(count: int) -> list[str]:
    return [t for r in range(count) for t in (ORDER if r % 2 == 0 else ORDER[::-1])]


def serve_and_heal(role: int, port: int, mb: int, transports: Sequence[str]) -> None:
    """One process: rank ``role`` (0 serves, 1 heals) of each transfer in ``transports``; the healer prints
    ``<transport> <seconds>`` per transfer."""
    from torch._C._distributed_c10d import TCPStore
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    from examples.ft_transport import PeerTransport

    timeout = timedelta(seconds=120)
    store = TCPStore("127.0.0.1", port, 2, is_master=role == 0, timeout=timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    pg.configure(f"127.0.0.1:{port}/heal", f"replica_group_{role}", role, 2)
    http = PeerTransport(timeout, "127.0.0.1")
    store.set(f"address{role}", http.metadata())
    offered = state(mb) if role == 0 else None
    for i, name in enumerate(transports):
        store.set(f"ready{role}-{i}", "1")
        store.wait([f"ready{1 - role}-{i}"])
        if role == 0:
            if name == "http":
                http.send_checkpoint([1], i, offered, timeout)
            else:
                PGTransport(pg, timeout, torch.device("cpu")).send_checkpoint([1], i, offered, timeout)
            store.wait([f"done-{i}"])
            http.disallow_checkpoint()
            continue
        start = time.perf_counter()
        if name == "http":
            got = http.recv_checkpoint(0, store.get("address0").decode(), i, timeout)
        else:
            got = PGTransport(pg, timeout, torch.device("cpu")).recv_checkpoint(0, "<n/a>", i, timeout)
        seconds = time.perf_counter() - start
        assert len(got) == len(state(mb))  # the state, whole
        assert float(got["t1"][0]) == 1.0
        store.set(f"done-{i}", "1")
        print(f"{name} {seconds:.6f}", flush=True)
    http.shutdown(wait=False)
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.heal_transfer", description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="the state's size, in megabytes")
    p.add_argument("--rounds", type=int, default=4, help="pairs of transfers, one by each transport")
    p.add_argument("--role", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    order = rounds(args.rounds)
    if args.role is not None:
        serve_and_heal(args.role, args.port, args.mb, order)
        return 0
    from opsd.backends.local.processes import listen_port

    port = listen_port()
    cmd = [sys.executable, "-m", "bench.heal_transfer", "--mb", str(args.mb), "--rounds", str(args.rounds)]
    server = subprocess.Popen([*cmd, "--role", "0", "--port", str(port)])
    healer = subprocess.run([*cmd, "--role", "1", "--port", str(port)], capture_output=True, text=True, timeout=900)
    server.wait(timeout=60)
    if healer.returncode != 0:
        print(healer.stderr[-3000:], file=sys.stderr)
        return 1
    times: dict[str, list[float]] = {name: [] for name in ORDER}
    size_mb = len(state(args.mb)) * TENSOR_BYTES / (1 << 20)
    for line in healer.stdout.splitlines():
        name, seconds = line.split()
        times[name].append(float(seconds))
        print(f"{name:>4}: {float(seconds):.3f} s, {size_mb / float(seconds):.0f} MB/s")
    http_s, pg_s = statistics.median(times["http"]), statistics.median(times["pg"])
    print(f"{size_mb:.0f} MB, medians: http {http_s:.3f} s ({size_mb / http_s:.0f} MB/s), pg {pg_s:.3f} s", end="")
    print(f" ({size_mb / pg_s:.0f} MB/s); CPU, loopback")
    print(f"heal_transfer_http_over_pg_ratio={http_s / pg_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
