"""`specserve stack` (mutual TLS and a token: the default) and `specserve stack --insecure`, side by side.

Both stacks run at once; each run sends the same greedy generation to one, then the other, so both see
the machine's conditions run by run. Each run has a prompt of its own: with a token, the TLS stack's
tenant suffix cache would draft a repeated prompt from its earlier output (fewer rounds, not less cost
per round). Prints each run's wall time and rounds, then per call what the network costs (the router's
view of a Verify or Propose minus the handler's own time) and each process's CPU seconds.
docs/security.md (what TLS costs) quotes:

    python scripts/diagnostics/tls_ab.py --out /tmp/tls-ab --max-new-tokens 64 --runs 4 --method glide-cape
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specserve.client import Client

PROMPTS = (
    "Write a short poem about the sea.",
    "List five uses of copper.",
    "Describe a cat in four sentences.",
    "Explain in three sentences what speculative decoding is.",
    "Give three tips for learning to cook.",
    "Describe the water cycle.",
)
ROLES = ("router", "target", "draft")
# Per-call latencies: (the router's view of the call, the handler's own time)
CALLS = {
    "verify": (("router", "verify_rpc_latency_seconds"), ("target", "verify_latency_seconds")),
    "propose": (("router", "draft_rpc_latency_seconds"), ("draft", "propose_latency_seconds")),
}


class Arm:
    """One `specserve stack` in a process group of its own (stopped as a whole, nothing left behind)."""

    def __init__(self, name: str, flags: list[str], base_port: int, out: Path) -> None:
        self.name, self.base_port, self.dir = name, base_port, out / name
        self.metrics = {role: base_port + 11 + i for i, role in enumerate(ROLES)}
        env = os.environ | {f"SPECSERVE_{r.upper()}_METRICS_PORT": str(p) for r, p in self.metrics.items()}
        self.log = out / f"{name}.log"
        command = [sys.executable, "-m", "specserve.cli", "stack", *flags, "--base-port", str(base_port)]
        command += ["--log-dir", str(self.dir), "--max-new-tokens", "4", "Hi."]
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_serving(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while "stack serving" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(1)

    def client(self) -> Client:
        if self.name == "plaintext":
            return Client(f"localhost:{self.base_port}")
        token = (self.dir / "api-tokens").read_text().split()[0]
        return Client(
            f"localhost:{self.base_port}", token=token, tls_ca_file=str(self.dir / "tls" / "ca.crt")
        )

    def scrape(self) -> dict[tuple[str, str], float]:
        """(role, metric) -> value, for the histograms' _sum and _count."""
        found = {}
        context = None
        if self.name != "plaintext":  # with TLS the metrics ports ask for the stack's client certificate
            tls_dir = self.dir / "tls"
            context = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
            context.load_cert_chain(tls_dir / "specserve-client.crt", tls_dir / "specserve-client.key")
        scheme = "http" if context is None else "https"
        for role, port in self.metrics.items():
            url = f"{scheme}://127.0.0.1:{port}/metrics"
            text = urllib.request.urlopen(url, timeout=5, context=context).read().decode()
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name.startswith("specserve:") and name.endswith(("_sum", "_count")):
                    found[role, name.removeprefix("specserve:")] = float(value)
        return found

    def cpu_seconds(self) -> dict[str, float]:
        """utime + stime of the stack's children (Redis and the three services)."""
        seconds = {}
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                role = "redis" if "redis" in command else command.rsplit("serve ", 1)[-1].strip()
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                seconds[role] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return seconds

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)  # the stack stops its children cleanly
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever is left of the group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the stacks' logs and files go here")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--method", default="glide-cape")
    # Below the ephemeral range (32768+), where another process's outgoing connection or free port
    # could take one of the stacks' ports.
    parser.add_argument("--base-port", type=int, default=23100, help="the TLS stack's; plaintext's is +100")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    arms = [Arm("tls", [], args.base_port, args.out)]
    try:
        arms[0].wait_serving()  # one at a time: two model loads at once starve a small machine
        arms.append(Arm("plaintext", ["--insecure"], args.base_port + 100, args.out))
        arms[1].wait_serving()
        clients = {arm.name: arm.client() for arm in arms}
        before = {arm.name: (arm.scrape(), arm.cpu_seconds()) for arm in arms}
        walls: dict[str, list[float]] = {arm.name: [] for arm in arms}
        for run in range(args.runs):
            prompt = PROMPTS[run % len(PROMPTS)]
            tokens = {}
            for name, client in clients.items():
                start = time.perf_counter()
                done = client.generate(prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                       method=args.method, timeout=600)  # fmt: skip
                walls[name].append(time.perf_counter() - start)
                tokens[name] = done.token_ids
                print(f"run {run} {name:9s} {walls[name][-1]:6.2f} s, "
                      f"{int(done.stats['num_target_forwards'])} target forwards", flush=True)  # fmt: skip
            assert len(set(map(tuple, tokens.values()))) == 1, "the stacks disagree"
        for arm in arms:
            metrics, cpu = before[arm.name]
            now, cpu_now = arm.scrape(), arm.cpu_seconds()
            delta = {key: value - metrics.get(key, 0.0) for key, value in now.items()}
            calls = []
            for call, (seen, handled) in CALLS.items():
                count = delta.get((seen[0], seen[1] + "_count"), 0.0)
                if count:
                    network = delta[seen[0], seen[1] + "_sum"] - delta[handled[0], handled[1] + "_sum"]
                    calls.append(f"{call} {network / count * 1e3:.2f} ms over its handler (x{int(count)})")
            used = ", ".join(f"{role} {cpu_now[role] - cpu.get(role, 0.0):.1f}" for role in sorted(cpu_now))
            print(f"{arm.name}: {sum(walls[arm.name]):.1f} s in all; {'; '.join(calls)}; CPU s: {used}")
    finally:
        for arm in arms:
            arm.stop()


if __name__ == "__main__":
    main()
