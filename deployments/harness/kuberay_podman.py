"""Run ``kuberay_pods`` plans as podman pods on a private podman network.

Everything made here carries the label ``dsv4-harness=<run>`` so ``cleanup`` removes it
all (pods, containers, network, volumes), also after a failure; ``leftovers`` counts
what the project's podman storage still holds (scripts/podman-env.sh: its own storage,
so a count of 0 is a count of everything). Each container runs as the manifest says:
its user, a read-only root, no capabilities, no privilege escalation, its CPU and
memory limits, emptyDirs as tmpfs, Secrets as read-only files; podman's ``--init``
(catatonit) is PID 1, so SIGTERM reaches ``ray start`` as the kubelet's would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deployments.harness.kuberay_pods import ContainerPlan, PodPlan, Probe

REPO = Path(__file__).resolve().parents[2]
PODMAN_TIMEOUT_S = 120


def podman_env() -> dict[str, str]:
    """This project's podman settings and storage (scripts/containers/)."""
    conf = REPO / "scripts" / "containers"
    for path in ("/var/lib/dsv4-serve/containers/networks", "/run/dsv4-serve/libpod/tmp"):
        Path(path).mkdir(parents=True, exist_ok=True)
    return os.environ | {"CONTAINERS_CONF": str(conf / "containers.conf"),
                         "CONTAINERS_STORAGE_CONF": str(conf / "storage.conf")}


def podman(*args: str, timeout: float = PODMAN_TIMEOUT_S, check: bool = True
           ) -> subprocess.CompletedProcess[str]:
    """One podman command with this project's settings; its stderr in the error."""
    proc = subprocess.run(["podman", *args], capture_output=True, text=True,  # noqa: S603, S607  # podman from PATH, our fixed arguments
                          timeout=timeout, env=podman_env())
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}... exited {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}")
    return proc


@dataclass
class Cluster:
    """The podman objects of one harness run."""

    run: str
    secrets: Mapping[str, Mapping[str, str]]
    network: str = ""
    pods: dict[str, PodPlan] = field(default_factory=dict)
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dsv4-kr-")))

    @property
    def label(self) -> str:
        return f"dsv4-harness={self.run}"

    def create_network(self) -> None:
        self.network = f"dsv4-kuberay-{self.run}"
        podman("network", "create", "--label", self.label, self.network)

    def _secret_dir(self, name: str) -> str:
        """A Secret volume: one file per key, root:100 0440 (defaultMode 288 + fsGroup)."""
        path = self.scratch / "secrets" / name
        if not path.exists():
            path.mkdir(parents=True)
            for key, value in self.secrets[name].items():
                (path / key).write_text(value)
                os.chown(path / key, 0, 100)
                os.chmod(path / key, 0o440)
            os.chmod(path, 0o755)  # noqa: S103  # a Secret volume's directory, as the kubelet makes it
        return str(path)

    def _container_args(self, pod: PodPlan, ctr: ContainerPlan) -> list[str]:
        env_file = self.scratch / f"{pod.name}-{ctr.name}.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in ctr.env.items()))
        os.chmod(env_file, 0o600)
        args = ["--pod", pod.name, "--name", f"{pod.name}-{ctr.name}", "--label", self.label,
                "--env-file", str(env_file), "--init", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--pull", "never"]
        if pod.user:
            args += ["--user", pod.user]
        if pod.read_only:
            args += ["--read-only", "--read-only-tmpfs=false"]
        if ctr.cpus:
            args += ["--cpus", f"{min(ctr.cpus, os.cpu_count() or 1):g}"]
        if ctr.memory:
            args += ["--memory", str(ctr.memory)]
        for path in pod.tmpfs:
            args += ["--mount", f"type=tmpfs,destination={path},tmpfs-mode=1777"]
        for path, secret in pod.secrets.items():
            args += ["-v", f"{self._secret_dir(secret)}:{path}:ro"]
        for path, claim in pod.volumes.items():
            args += ["-v", f"{claim}-{self.run}:{path}:U"]
        return args

    def create_pod(self, pod: PodPlan, publish: Sequence[str] = ()) -> None:
        """The pod (infra holds the network and /dev/shm), its init and ray containers."""
        args = ["pod", "create", "--name", pod.name, "--label", self.label,
                "--network", self.network, "--hostname", pod.name,
                "--shm-size", f"{max(pod.shm_bytes // 2**20, 64)}m"]
        for alias in pod.aliases:
            args += ["--network-alias", alias]
        for port in publish:  # the Service's port, on loopback only
            args += ["-p", f"127.0.0.1::{pod.ports.get(port, port)}"]
        podman(*args)
        for claim in pod.volumes.values():
            if podman("volume", "exists", f"{claim}-{self.run}", check=False).returncode:
                podman("volume", "create", "--label", self.label, f"{claim}-{self.run}")
        if pod.init is not None:
            podman("create", "--init-ctr", "always", *self._container_args(pod, pod.init),
                   pod.init.image, *pod.init.command)
        podman("create", *self._container_args(pod, pod.ray), pod.ray.image,
               *pod.ray.command)
        self.pods[pod.name] = pod

    def start_pod(self, name: str, timeout: float) -> None:
        """``pod start``: init containers run to completion first, then the ray one."""
        podman("pod", "start", name, timeout=timeout)

    def host_port(self, pod: str, container_port: int) -> int:
        out = podman("pod", "inspect", pod).stdout
        data = json.loads(out)
        data = data[0] if isinstance(data, list) else data
        infra = data["InfraContainerID"]
        line = podman("port", infra, f"{container_port}/tcp").stdout.strip()
        return int(line.rsplit(":", 1)[1])

    def probe(self, pod: str, probe: Probe) -> bool:
        """One run of a probe inside the pod's ray container (its timeout as the kubelet's)."""
        ctr = f"{pod}-{self.pods[pod].ray.name}"
        try:
            proc = podman("exec", ctr, *probe.command, timeout=probe.timeout_s + 5,
                          check=False)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0

    def wait_ready(self, pod: str, timeout: float) -> float:
        """Seconds until the readiness probe passes (after its initial delay, every period)."""
        plan, start = self.pods[pod].ray.readiness, time.monotonic()
        assert plan is not None
        time.sleep(min(plan.initial_delay_s, timeout))
        while time.monotonic() - start < timeout:
            if not self.running(pod):
                raise AssertionError(f"{pod}: ray container exited before ready:\n"
                                     f"{self.logs(pod)[-3000:]}")
            if self.probe(pod, plan):
                return time.monotonic() - start
            time.sleep(plan.period_s)
        raise AssertionError(f"{pod}: not ready in {timeout} s:\n{self.logs(pod)[-3000:]}")

    def running(self, pod: str) -> bool:
        ctr = f"{pod}-{self.pods[pod].ray.name}"
        proc = podman("inspect", "--format", "{{.State.Running}}", ctr, check=False)
        return proc.stdout.strip() == "true"

    def logs(self, pod: str) -> str:
        ctr = f"{pod}-{self.pods[pod].ray.name}"
        proc = podman("logs", ctr, check=False)
        return proc.stdout + proc.stderr

    def exec(self, pod: str, *command: str, timeout: float = 60) -> str:
        ctr = f"{pod}-{self.pods[pod].ray.name}"
        return podman("exec", ctr, *command, timeout=timeout, check=False).stdout

    def kill(self, pod: str) -> None:
        podman("kill", "--signal", "KILL", f"{pod}-{self.pods[pod].ray.name}")

    def remove_pod(self, pod: str) -> None:
        podman("pod", "rm", "--force", "--time", "0", pod, timeout=180)
        self.pods.pop(pod, None)

    def cleanup(self) -> None:
        """Everything this run made: pods (with their containers), volumes, network."""
        for kind in ("pod", "container", "volume"):
            ids = podman(kind, "ls" if kind != "pod" else "ps", "-q", "--filter",
                         f"label={self.label}", *(["-a"] if kind == "container" else []),
                         check=False).stdout.split()
            if ids:
                rm = ["rm", "--force"] + (["--time", "0"] if kind != "volume" else [])
                podman(kind, *rm, *ids, timeout=300, check=False)
        if self.network:
            podman("network", "rm", "--force", self.network, check=False)
        shutil.rmtree(self.scratch, ignore_errors=True)


def leftovers() -> dict[str, int]:
    """Containers, pods and networks (besides podman's default) in the project storage."""
    containers = podman("ps", "-a", "-q", check=False).stdout.split()
    pods = podman("pod", "ps", "-q", check=False).stdout.split()
    networks = [n for n in podman("network", "ls", "--format", "{{.Name}}",
                                  check=False).stdout.split() if n != "podman"]
    return {"containers": len(containers), "pods": len(pods), "networks": len(networks)}
