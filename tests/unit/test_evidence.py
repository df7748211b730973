"""Evidence preservation on a hand-made run directory: what is copied, what is recorded, and how it is verified."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rankwatch.base.rundir import CHECKPOINT_DIR, EVIDENCE_DIR, LINEAGE_FILE, RUN_FILE, TELEMETRY_DIR
from rankwatch.base.schema import PARTITION_KEY, Table
from rankwatch.recovery import evidence as ev
from rankwatch.recovery.catalog import MANIFEST, sha256_file
from rankwatch.recovery.evidence import EVIDENCE_FILE, Method, preserve_evidence, verify_evidence

pytestmark = pytest.mark.timeout(30)

WORLD = 4
OLD_NS = 1_000_000_000_000_000_000
NEW_NS = 2_000_000_000_000_000_000


def part(run: Path, table: Table, rank: int, n: int, *, mtime_ns: int = NEW_NS) -> str:
    rel = f"{TELEMETRY_DIR}/{table}/{PARTITION_KEY}={rank}/part-{n:06d}.parquet"
    path = run / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"rank": [rank] * 3, "n": [n, n + 1, n + 2]}), path)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return rel


def make_run(run: Path) -> dict[str, list[str]]:
    """Four ranks; steps has an old and a new part per rank; events and topology one old part per rank."""
    parts: dict[str, list[str]] = {"old_steps": [], "new_steps": [], "small": []}
    for r in range(WORLD):
        parts["old_steps"].append(part(run, Table.STEPS, r, 0, mtime_ns=OLD_NS))
        parts["new_steps"].append(part(run, Table.STEPS, r, 1))
        parts["small"].append(part(run, Table.EVENTS, r, 0, mtime_ns=OLD_NS))
        parts["small"].append(part(run, Table.TOPOLOGY, r, 0, mtime_ns=OLD_NS))
    # A writer's in-flight temporary is not a part file.
    (run / TELEMETRY_DIR / str(Table.STEPS) / f"{PARTITION_KEY}=1" / ".part-000002.parquet.tmp").write_bytes(b"x")
    committed = run / CHECKPOINT_DIR / "step-00000010"
    (committed / "model_optim").mkdir(parents=True)
    (committed / "model_optim" / "__0_0.distcp").write_bytes(b"a" * 100)
    (committed / MANIFEST).write_text(json.dumps({"step": 10}))
    partial = run / CHECKPOINT_DIR / ".step-00000020.tmp"
    (partial / "model_optim").mkdir(parents=True)
    (partial / "model_optim" / "__0_0.distcp").write_bytes(b"b" * 37)
    (partial / "rank-00001.pt").write_bytes(b"c" * 5)
    (run / CHECKPOINT_DIR / "step-00000030").mkdir()  # published but its manifest is gone
    (run / RUN_FILE).write_text(json.dumps({"launches": [{"attempt": 0}]}))
    (run / LINEAGE_FILE).write_text('{"kind": "start"}\n')
    (run / "analysis").mkdir()
    (run / "analysis" / "incidents.json").write_text('[{"id": "inc-1"}]')
    return parts


def sources(bundle: ev.EvidenceBundle) -> set[str]:
    return {f.source for f in bundle.files}


def test_copies_affected_ranks_all_small_tables_and_run_files(tmp_path: Path) -> None:
    parts = make_run(tmp_path)
    b = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[1, 2], note="straggler rollback")
    assert b.path == tmp_path / EVIDENCE_DIR / "inc-1"
    affected = (f"{PARTITION_KEY}=1/", f"{PARTITION_KEY}=2/")
    steps = {p for p in parts["old_steps"] + parts["new_steps"] if any(a in p for a in affected)}
    expected = steps | set(parts["small"]) | {RUN_FILE, LINEAGE_FILE, "analysis/incidents.json"}
    assert sources(b) == expected
    assert b.copied == len(expected) and b.bytes == sum(f.size for f in b.files)
    for f in b.files:
        assert f.path == f.source
        assert (b.path / f.path).read_bytes() == (tmp_path / f.source).read_bytes()
        assert f.method is (Method.LINK if f.source.startswith(TELEMETRY_DIR) else Method.COPY)
    assert b.missing == ()
    assert verify_evidence(b.path) == ()


def test_since_filters_affected_ranks_but_not_events_and_topology(tmp_path: Path) -> None:
    parts = make_run(tmp_path)
    b = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[3], since_wall_ns=(OLD_NS + NEW_NS) // 2)
    telemetry = {s for s in sources(b) if s.startswith(TELEMETRY_DIR)}
    assert telemetry == {parts["new_steps"][3]} | set(parts["small"])


def test_manifests_and_partial_listing(tmp_path: Path) -> None:
    make_run(tmp_path)
    b = preserve_evidence(
        tmp_path, incident_id="inc-1", ranks=[], checkpoint_ids=["step-00000010", "step-00000020", "step-00000030",
                                                                  "step-00000099"]
    )
    assert b.manifests == (f"{CHECKPOINT_DIR}/step-00000010/{MANIFEST}",)
    assert json.loads((b.path / b.manifests[0]).read_text()) == {"step": 10}
    by_dir = {c.directory: c for c in b.checkpoints}
    partial = by_dir[f"{CHECKPOINT_DIR}/.step-00000020.tmp"]
    assert partial.partial and partial.manifest is None
    assert [(f.path, f.size) for f in partial.listing] == [("model_optim/__0_0.distcp", 37), ("rank-00001.pt", 5)]
    assert not any(s.startswith(f"{CHECKPOINT_DIR}/.step-00000020.tmp/model_optim") for s in sources(b))
    assert {m.source for m in b.missing} == {
        f"{CHECKPOINT_DIR}/step-00000030/{MANIFEST}",
        f"{CHECKPOINT_DIR}/step-00000099",
    }
    doc = json.loads((b.path / EVIDENCE_FILE).read_text())
    listed = doc["calls"][-1]["checkpoints"]
    assert [c["directory"] for c in listed] == [c.directory for c in b.checkpoints]
    assert listed[1]["listing"] == [
        {"path": "model_optim/__0_0.distcp", "size": 37},
        {"path": "rank-00001.pt", "size": 5},
    ]


def test_evidence_json_is_complete_and_verifiable(tmp_path: Path) -> None:
    make_run(tmp_path)
    b = preserve_evidence(tmp_path, incident_id="inc-7", ranks=[0], since_wall_ns=5, note="why")
    doc = json.loads((b.path / EVIDENCE_FILE).read_text())
    assert doc["incident_id"] == "inc-7" and doc["ranks"] == [0] and doc["since_wall_ns"] == 5 and doc["note"] == "why"
    assert doc["wall_ns"] > 0 and doc["missing"] == []
    assert {d["path"] for d in doc["files"]} == {f.path for f in b.files}
    for d in doc["files"]:
        assert d["size"] == (b.path / d["path"]).stat().st_size
        assert d["sha256"] == sha256_file(b.path / d["path"])
    assert not [p for p in b.path.rglob("*") if ".tmp" in p.name]
    assert verify_evidence(b.path) == ()


def test_verify_reports_tampering_and_incompleteness(tmp_path: Path) -> None:
    make_run(tmp_path)
    b = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[0])
    (b.path / RUN_FILE).write_text(json.dumps({"launches": [{"attempt": 9}]}))  # same size, other bytes
    lineage_copy = b.path / LINEAGE_FILE
    lineage_copy.write_text(lineage_copy.read_text() + "{}\n")
    (b.path / "analysis" / "incidents.json").unlink()
    (b.path / "extra.txt").write_text("planted")
    problems = verify_evidence(b.path)
    assert len(problems) == 4
    assert any(p.startswith(RUN_FILE) and "SHA-256" in p for p in problems)
    assert any(p.startswith(LINEAGE_FILE) and "size" in p for p in problems)
    assert any(p.startswith("analysis/incidents.json") and "missing" in p for p in problems)
    assert any(p.startswith("extra.txt") and "not listed" in p for p in problems)
    (b.path / EVIDENCE_FILE).unlink()
    assert len(verify_evidence(b.path)) == 1 and "incomplete" in verify_evidence(b.path)[0]


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".", "../x", "a..b", ".hidden", "a\\b", "a\nb", "/abs"])
def test_bad_incident_ids_rejected(tmp_path: Path, bad: str) -> None:
    make_run(tmp_path)
    with pytest.raises(ValueError, match="incident_id") as info:
        preserve_evidence(tmp_path, incident_id=bad, ranks=[0])
    assert "\n" not in str(info.value)
    assert not (tmp_path / EVIDENCE_DIR).exists()


def test_missing_run_dir_and_bad_arguments_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run directory does not exist"):
        preserve_evidence(tmp_path / "nope", incident_id="inc-1", ranks=[0])
    make_run(tmp_path)
    with pytest.raises(ValueError, match="checkpoint id"):
        preserve_evidence(tmp_path, incident_id="inc-1", ranks=[0], checkpoint_ids=["../step-00000010"])
    with pytest.raises(ValueError, match="rank -1"):
        preserve_evidence(tmp_path, incident_id="inc-1", ranks=[-1])


def test_idempotent_second_call_adds_only_and_keeps_changed_versions(tmp_path: Path) -> None:
    make_run(tmp_path)
    first = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[0])
    again = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[0])
    assert again.copied == 0 and again.files == first.files
    new_part = part(tmp_path, Table.STEPS, 0, 5)
    with open(tmp_path / LINEAGE_FILE, "a") as f:
        f.write('{"kind": "rollback"}\n')
    third = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[0, 1], note="second look")
    assert {f.path for f in first.files} < {f.path for f in third.files}
    assert new_part in sources(third)
    lineage = sorted((f for f in third.files if f.source == LINEAGE_FILE), key=lambda f: f.wall_ns)
    assert [f.path for f in lineage] == [LINEAGE_FILE, "lineage.v2.jsonl"]
    assert (third.path / LINEAGE_FILE).read_text() == '{"kind": "start"}\n'
    assert (third.path / "lineage.v2.jsonl").read_text().endswith('{"kind": "rollback"}\n')
    doc = json.loads((third.path / EVIDENCE_FILE).read_text())
    assert [c["note"] for c in doc["calls"]] == ["", "", "second look"] and doc["ranks"] == [0, 1]
    assert verify_evidence(third.path) == ()


def test_originals_deleted_after_preservation_survive(tmp_path: Path) -> None:
    parts = make_run(tmp_path)
    b = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[2], checkpoint_ids=["step-00000010"])
    for p in parts["new_steps"]:
        (tmp_path / p).unlink()
    (tmp_path / CHECKPOINT_DIR / "step-00000010" / MANIFEST).unlink()
    assert verify_evidence(b.path) == ()
    again = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[2])
    assert {f.path for f in b.files} <= {f.path for f in again.files}
    assert verify_evidence(again.path) == ()


def test_file_vanishing_between_listing_and_copy_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = make_run(tmp_path)
    victim = tmp_path / parts["new_steps"][1]
    real = ev._part_files

    def list_then_delete(path: Path) -> list[Path]:
        listed = real(path)
        if victim in listed:
            victim.unlink()
        return listed

    monkeypatch.setattr(ev, "_part_files", list_then_delete)
    b = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[1])
    assert [(m.source, "vanished" in m.reason) for m in b.missing] == [(parts["new_steps"][1], True)]
    assert parts["old_steps"][1] in sources(b)
    doc = json.loads((b.path / EVIDENCE_FILE).read_text())
    assert [m["source"] for m in doc["missing"]] == [parts["new_steps"][1]]
    assert verify_evidence(b.path) == ()


def test_unreadable_file_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_run(tmp_path)
    real = ev.shutil.copyfile

    def deny_lineage(src: Path, dst: Path) -> object:
        if Path(src).name == LINEAGE_FILE:
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return real(src, dst)

    monkeypatch.setattr(ev.shutil, "copyfile", deny_lineage)
    b = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[0])
    assert [(m.source, "unreadable" in m.reason) for m in b.missing] == [(LINEAGE_FILE, True)]
    assert LINEAGE_FILE not in sources(b)
    assert verify_evidence(b.path) == ()


def test_falls_back_to_copy_across_filesystems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_run(tmp_path)

    def no_link(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    b = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[0])
    telemetry = [f for f in b.files if f.source.startswith(TELEMETRY_DIR)]
    assert telemetry and all(f.method is Method.COPY for f in telemetry)
    assert all((b.path / f.path).stat().st_nlink == 1 for f in telemetry)
    assert verify_evidence(b.path) == ()


def test_every_ranks_liveness_and_exit_record_is_preserved(tmp_path: Path) -> None:
    make_run(tmp_path)
    live = tmp_path / "live"
    live.mkdir()
    for name, data in (("rank-0.live", b"r0"), ("rank-1.live", b"r1"), ("exit-1.json", b'{"rank": 1}'),
                       (".rank-2.tmp", b"half")):
        (live / name).write_bytes(data)
    b = preserve_evidence(tmp_path, incident_id="inc-1", ranks=[1])
    kept = {s for s in sources(b) if s.startswith("live/")}
    assert kept == {"live/rank-0.live", "live/rank-1.live", "live/exit-1.json"}
    assert (b.path / "live" / "exit-1.json").read_bytes() == b'{"rank": 1}' and verify_evidence(b.path) == ()
