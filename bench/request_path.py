"""Which of pdserve's files one streaming chat request passes through (docs/architecture.md).

One disaggregated cluster (1P1D, SmolLM2, in one process: no Ray) behind the gateway app; one
streaming chat request; every Python function called on any thread while it runs is recorded by
`sys.setprofile`, and the files of pdserve's packages that those functions live in are listed.

    python -m bench.request_path [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kvtransfer", "prefill_worker", "decode_worker", "router", "gateway", "cluster")


def _recorder(seen: set[str], recording: threading.Event):
    def profile(frame, event, arg):
        if event == "call" and recording.is_set():
            seen.add(frame.f_code.co_filename)
    return profile


def trace_one_request(model: str = "smollm2") -> list[str]:
    """The repository-relative paths of the package files a streaming chat request ran code in."""
    from fastapi.testclient import TestClient

    from cluster.control.cluster import Cluster
    from cluster.spec import ClusterSpec
    from engine.loading.loader import resolve_model_path
    from engine.text.tokenizer import Tokenizer
    from gateway.app import create_app

    spec = ClusterSpec(model=model, dtype="float32", device="cpu", num_kv_blocks=64, block_size=16, num_threads=1,
                       attention_backend="torch")
    body = {"model": "smollm2", "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    seen: set[str] = set()
    recording = threading.Event()
    threading.setprofile(_recorder(seen, recording))  # before the cluster's and the app's threads start
    sys.setprofile(_recorder(seen, recording))
    try:
        with Cluster(spec, use_ray=False) as cluster:
            app = create_app(cluster, Tokenizer.from_path(resolve_model_path(model)), "smollm2", None)
            with TestClient(app) as client:
                client.post("/v1/chat/completions", json={**body, "max_tokens": 2}).read()  # warm: first step
                recording.set()
                client.post("/v1/chat/completions", json=body).read()
                recording.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    files = set()
    for name in seen:
        path = Path(name)
        if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PACKAGES:
            files.add(str(path.relative_to(ROOT)))
    return sorted(files)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    files = trace_one_request(args.model)
    by_package = defaultdict(list)
    for f in files:
        by_package[f.split("/")[0]].append(f)
    if args.json:
        print(json.dumps({"num_files": len(files), "num_packages": len(by_package), "files": files}))
        return
    for package, names in by_package.items():
        print(f"{package} ({len(names)}): {', '.join(Path(n).name for n in names)}")
    print(f"{len(files)} files in {len(by_package)} packages")


if __name__ == "__main__":
    main()
