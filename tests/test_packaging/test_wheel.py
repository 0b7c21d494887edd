"""`pip install dsv4-serve` works: the wheel carries its configs and runs from a fresh venv.

The wheel is built from a copy of the sources (nothing is written into the
checkout) and installed with ``--no-deps --no-index`` into a new venv whose only
link to the project venv is a ``.pth`` line naming its site-packages, so the
dependencies (vLLM, Ray, pydantic) come from there without network, while
``deployments``/``dsv4_patch`` and their data can only come from the wheel. Every
command runs with a working directory outside the checkout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "deployments", "dsv4_patch", "configs", "k8s")

pytestmark = pytest.mark.slow  # ~30 s: a wheel build, a venv, `import vllm` for doctor


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode in (0, 1), f"{cmd} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the built wheel installed; returns its bin directory."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        item = ROOT / name
        if item.is_dir():
            shutil.copytree(item, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(item, src / name)
    dist = work / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(dist), str(src)], check=True, cwd=work,
                   capture_output=True, timeout=300)
    [wheel] = dist.glob("dsv4_serve-*.whl")
    env_dir = work / "venv"
    venv.create(env_dir, with_pip=False)
    bin_dir = env_dir / "bin"
    purelib = subprocess.run([str(bin_dir / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # Dependencies from the project venv; its own .pth files (the editable install) are
    # not processed from a .pth-added directory, so our packages come from the wheel.
    (Path(purelib) / "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"),
                    "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    return bin_dir


def test_wheel_loads_its_shipped_configs(installed: Path, tmp_path: Path) -> None:
    code = (
        "import json, deployments, deployments.config as c\n"
        "from deployments.k8s import params as p, render as r\n"
        "cfg = c.load_serve_config(c.DEFAULT_CONFIG)\n"
        "print(json.dumps({'pkg': deployments.__file__, 'default': str(c.DEFAULT_CONFIG),\n"
        "  'model': cfg.ours()[0][1].llm.model_loading_config.model_id,\n"
        "  'params': str(p.DEFAULT_PARAMS), 'presets': len(r.render_all())}))\n")
    out = json.loads(_run([str(installed / "python"), "-c", code], tmp_path).stdout)
    assert str(ROOT) not in out["pkg"] and "site-packages" in out["pkg"]
    assert Path(out["default"]).is_file() and "site-packages" in out["default"]
    assert out["model"] == "dsv4-tiny" and Path(out["params"]).is_file()
    # Every manifest the repo ships renders from the wheel (a new preset counts itself).
    assert out["presets"] == len(list((ROOT / "k8s").glob("*.rayservice.yaml")))


def _source_modules() -> list[str]:
    """Every module of our two packages in the checkout, dotted."""
    names = []
    for top in ("deployments", "dsv4_patch"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            names.append(".".join(parts))
    return names


def test_wheel_ships_every_module_of_the_tree(installed: Path, tmp_path: Path) -> None:
    """A subpackage left out of pyproject's ``packages`` is missing from the wheel."""
    modules = _source_modules()
    code = ("import importlib.util, json, sys\n"
            "names = json.loads(sys.argv[1])\n"
            "print(json.dumps([n for n in names if importlib.util.find_spec(n) is None]))\n")
    out = _run([str(installed / "python"), "-c", code, json.dumps(modules)], tmp_path)
    assert json.loads(out.stdout) == [], "modules missing from the wheel"
    assert len(modules) > 90  # the tree was read


def test_wheel_cli_doctor_plan_and_k8s_check(installed: Path, tmp_path: Path) -> None:
    cli = str(installed / "dsv4-serve")
    doctor = _run([cli, "doctor"], tmp_path)
    assert doctor.returncode == 0 and "plugin entry point: installed" in doctor.stdout
    configs = Path(json.loads(_run([str(installed / "python"), "-c",
                                    "import json; from deployments import resources; "
                                    "print(json.dumps(str(resources.configs_dir())))"],
                                   tmp_path).stdout))
    plan = _run([cli, "plan", str(configs / "flash-h200.yaml")], tmp_path)
    assert plan.returncode == 0 and "verdict: ok" in plan.stdout
    check = _run([cli, "k8s", "check"], tmp_path)  # shipped = rendered, monitors included
    assert check.returncode == 0, check.stdout + check.stderr


def test_wheel_error_fix_names_a_path_that_exists(installed: Path, tmp_path: Path) -> None:
    done = subprocess.run([str(installed / "dsv4-serve"), "plan", "nope.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    named = done.stderr.split("e.g. ", 1)[1].strip().rstrip(".")
    assert Path(named).is_file(), done.stderr
