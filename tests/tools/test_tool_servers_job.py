"""``python -m jobs.tool_servers``: start the servers, publish the addresses file, serve, stop cleanly; on Slurm too."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from afm_core.tools import build_tool_pool
from afm_core.tools.addresses import read_addresses
from afm_core.tools.launcher import ServerGroup, server_args
from tests.tools.conftest import jail_unavailable

REPO = Path(__file__).resolve().parents[2]


def start_job(tmp_path: Path, data_dir: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    addresses = tmp_path / "addresses.json"
    argv = [
        sys.executable,
        "-m",
        "jobs.tool_servers",
        f"addresses_file={addresses}",
        f"data_dir={data_dir}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        *overrides,
    ]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, addresses


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the supervisor (it stops its servers), SIGKILL it if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"jobs.tool_servers exited with {proc.returncode}:\n{proc.stdout.read()}")
        assert time.monotonic() < deadline, "no addresses file"
        time.sleep(0.2)


def tools_config(addresses: Path) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "tools" / "default.yaml"), resolve=False)
    cfg["addresses_file"] = str(addresses)
    cfg["cache"] = None
    cfg["tools"]["crawl_page"] = None  # the crawl server is not started in these tests
    return cfg


def call_every_tool(cfg: dict) -> list[str]:
    async def main():
        async with build_tool_pool(cfg) as pool:
            return await pool.call_many(
                [
                    ("code", "```py\nprint(2 + 2)\n```"),
                    ("wiki_search", "Shirley Temple Chief of Protocol"),
                    ("web_search", "Hermitian matrix"),
                ]
            )

    return asyncio.run(main())


@pytest.mark.skipif(jail_unavailable() is not None, reason="bubblewrap cannot create namespaces here")
def test_local_servers_addresses_and_clean_stop(tmp_path, data_dir):
    proc, addresses = start_job(tmp_path, data_dir, "servers.crawl=null")
    try:
        wait_for(addresses, proc)
        servers = read_addresses(addresses)
        assert sorted(servers) == ["pages", "sandbox", "web_search", "wiki"]
        assert all(url.startswith("http://127.0.0.1:") for url in servers.values())
        code, wiki, web = call_every_tool(tools_config(addresses))
        assert code == "[EXECUTED] Code exited with status 0.\n[STDOUT:BEGIN]\n4\n[STDOUT:END]"
        assert wiki.startswith('Doc 1 (Title: "Shirley Temple")')
        assert web.startswith("Found ") and "1. [Hermitian matrix](" in web and "/pages/wikipedia-3)" in web
        children = psutil.Process(proc.pid).children()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        stop(proc)
    assert not addresses.exists()  # stale addresses are never left behind
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    assert (tmp_path / "logs" / "wiki.log").exists()


def test_a_group_without_a_log_dir_removes_its_temp_folder_at_stop(data_dir):
    """``ServerGroup()`` (as ``benchmarks/tools_load.py`` runs it) logs to a temp folder of its own and removes it."""
    with ServerGroup() as group:
        group.launch("wiki", ["--corpus", str(data_dir / "mhqa" / "hotpotqa500" / "corpus.jsonl")])
        group.wait()
        assert (group.log_dir / "wiki.log").is_file()
    assert not group.log_dir.exists()


def test_a_dying_server_stops_the_group(tmp_path, data_dir):
    proc, addresses = start_job(
        tmp_path, data_dir, "servers.crawl=null", "servers.sandbox=null", "servers.web_search=null"
    )
    try:
        wait_for(addresses, proc)
        wiki = next(
            c for c in psutil.Process(proc.pid).children() if "afm_core.tools.servers.wiki" in " ".join(c.cmdline())
        )
        wiki.kill()
        assert proc.wait(timeout=60) == 1
    finally:
        stop(proc)
    assert not addresses.exists()


def test_servers_die_with_a_killed_supervisor(tmp_path, data_dir):
    proc, addresses = start_job(
        tmp_path, data_dir, "servers.crawl=null", "servers.sandbox=null", "servers.web_search=null"
    )
    try:
        wait_for(addresses, proc)
        children = psutil.Process(proc.pid).children()
        proc.kill()  # no chance to clean up
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert alive == []
    finally:
        stop(proc)


def test_bad_server_config_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"servers.wiki.corpus: .*does not exist"):
        server_args("wiki", {"corpus": "no/such/corpus.jsonl"}, tmp_path)
    with pytest.raises(ValueError, match=r"servers\.nope: unknown server"):
        server_args("nope", {}, tmp_path)
    assert server_args(
        "sandbox", {"port": 0, "ro_paths": ["/a", "/b"], "nsjail_path": None, "max_queue": 8}, tmp_path
    ) == ["--ro-path", "/a", "--ro-path", "/b", "--max-queue", "8"]


def test_addresses_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"waited 0\.2 s"):
        read_addresses(tmp_path / "none.json", wait_s=0.2)
    bad = tmp_path / "a.json"
    bad.write_text('{"servers": ["x"]}')
    with pytest.raises(ValueError, match="field 'servers'"):
        read_addresses(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match=r"a.json:1: not valid JSON"):
        read_addresses(bad)


def test_tools_config_errors_name_the_field(tmp_path):
    from afm_core.tools import build_tools

    with pytest.raises(ValueError, match=r"tools.wiki_search.server: 'wiki' is not in the addresses file"):
        build_tools({"wiki_search": {"server": "wiki"}}, {})
    with pytest.raises(ValueError, match=r"tools.code: unexpected|tools.code: .*unexpected keyword"):
        build_tools({"code": {"url": "http://x", "colour": "red"}}, {})
    with pytest.raises(ValueError, match=r"tools\.calculator: unknown tool"):
        build_tools({"calculator": {"url": "http://x"}}, {})
    tools, limits = build_tools(
        {"web_search": {"url": "https://google.serper.dev", "limits": {"retries": 5}}, "code": None}, {}
    )
    assert [t.name for t in tools] == ["web_search"] and limits["web_search"].retries == 5


@pytest.mark.slow
@pytest.mark.slurm
def test_on_slurm(tmp_path, data_dir):
    """Submitted with submitit to the local Slurm cluster (slurm/local-cluster.sh start)."""
    if shutil.which("sbatch") is None or subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        pytest.skip("no reachable Slurm cluster (slurm/local-cluster.sh start)")
    if jail_unavailable() is not None:
        pytest.skip(jail_unavailable())
    proc, addresses = start_job(
        tmp_path,
        data_dir,
        "cluster=slurm",
        "servers.crawl=null",
        "serve_for_s=60",
        "cluster.time=10",
        "cluster.cpus_per_task=2",
        "cluster.signal_delay_s=30",
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode == 0, out
    job_id = out.split("Slurm job ")[1].split(";")[0]
    try:
        payload = json.loads(addresses.read_text())
        assert payload["slurm_job_id"] == job_id
        code, wiki, web = call_every_tool(tools_config(addresses))
        assert "4" in code and wiki.startswith("Doc 1") and web.startswith("Found")
    finally:
        subprocess.run(["scancel", job_id], check=False)
    deadline = time.monotonic() + 120
    while addresses.exists() and time.monotonic() < deadline:  # the job removes it when it stops
        time.sleep(1)
    assert not addresses.exists()
    assert os.path.isdir(tmp_path / "slurm")
