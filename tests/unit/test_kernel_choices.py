"""The fast runtime's kernel choices, measured once per machine and read back (engine/fast/choices.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agent_mtp.engine.fast import blockq, choices
from agent_mtp.engine.fast.choices import CHOICES_ENV, StoredChoices, row_pair, rows_or_never, whole_number
from agent_mtp.errors import ConfigError

SHAPES = [(576, 1728, "q4_1"), (576, 49152, "q8_0")]


def _open(
    root: Path, *, build: str = "b1", shapes: list[tuple[int, int, str]] = SHAPES, threads: int = 2
) -> StoredChoices:
    return StoredChoices.open(root, build=build, shapes=shapes, threads=threads)


class Measure:
    """A measurement that counts its calls and returns ``value``."""

    def __init__(self, value: int) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> int:
        self.calls += 1
        return self.value


def test_a_choice_is_measured_once_stored_and_read_back_by_the_next_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CHOICES_ENV, raising=False)
    measure = Measure(9)
    first = _open(tmp_path)
    assert first.get("buffered_rows", measure, int, whole_number) == 9 and measure.calls == 1
    first.save()
    data = json.loads(first.path.read_text())
    assert data == {"format": choices.CHOICES_FORMAT, "choices": {"buffered_rows": 9}}
    second = _open(tmp_path)
    assert second.get("buffered_rows", Measure(5), int, whole_number) == 9  # read, not measured
    assert second.read == ["buffered_rows"] and second.measured == []
    # a choice the file lacks is measured and added beside the stored ones
    assert second.get("block_rows", Measure(12), int, whole_number) == 12
    second.save()
    assert json.loads(second.path.read_text())["choices"] == {"buffered_rows": 9, "block_rows": 12}


def test_another_machine_build_shape_or_thread_count_measures_afresh(tmp_path: Path) -> None:
    stored = _open(tmp_path)
    stored.get("block_rows", Measure(4), int, whole_number)
    stored.save()
    others = [
        _open(tmp_path, build="b2"),
        _open(tmp_path, shapes=[(576, 1728, "q8_0")]),
        _open(tmp_path, threads=1),
    ]
    assert len({stored.path, *(o.path for o in others)}) == 4
    for other in others:
        measure = Measure(7)
        assert other.get("block_rows", measure, int, whole_number) == 7 and measure.calls == 1


def test_measure_mode_measures_every_choice_again_and_replaces_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored = _open(tmp_path)
    stored.get("block_rows", Measure(4), int, whole_number)
    stored.save()
    monkeypatch.setenv(CHOICES_ENV, "measure")
    again, measure = _open(tmp_path), Measure(16)
    assert again.get("block_rows", measure, int, whole_number) == 16 and measure.calls == 1
    again.save()
    monkeypatch.setenv(CHOICES_ENV, "stored")
    assert _open(tmp_path).get("block_rows", Measure(1), int, whole_number) == 16


def test_measure_mode_keeps_the_choices_a_later_block_does_not_ask_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast model settles its kernel choices, then times the output head's screen on the finished model in a
    second block: in measure mode that block must not drop what the first one stored."""
    monkeypatch.setenv(CHOICES_ENV, "measure")
    first = _open(tmp_path)
    first.get("block_rows", Measure(16), int, whole_number)
    first.save()
    second, measure = _open(tmp_path), Measure(0)
    assert second.get("screen_rows", measure, int, rows_or_never) == 0 and measure.calls == 1
    second.save()
    monkeypatch.setenv(CHOICES_ENV, "stored")
    again = _open(tmp_path)
    assert again.get("block_rows", Measure(1), int, whole_number) == 16
    assert again.get("screen_rows", Measure(6), int, rows_or_never) == 0
    assert again.read == ["block_rows", "screen_rows"]


@pytest.mark.parametrize("value", [-1, True, 1.5, "6", None])
def test_a_stored_screen_threshold_must_be_a_whole_number_of_rows_or_zero(value: object) -> None:
    with pytest.raises(ValueError, match="whole number of rows >= 0"):
        rows_or_never(value)


def test_an_unknown_mode_is_refused_naming_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHOICES_ENV, "sometimes")
    with pytest.raises(ConfigError, match=r"AGENT_MTP_KERNEL_CHOICES='sometimes'.*'measure'"):
        choices.choices_mode()


@pytest.mark.parametrize(
    "body",
    [
        "{not json",
        json.dumps({"format": 0, "choices": {"block_rows": 4}}),  # another format
        json.dumps(["block_rows", 4]),
        json.dumps({"format": choices.CHOICES_FORMAT, "choices": {"block_rows": 0}}),  # not a choice
        json.dumps({"format": choices.CHOICES_FORMAT, "choices": {"block_rows": "4"}}),
        json.dumps({"format": choices.CHOICES_FORMAT, "choices": {"block_rows": True}}),
    ],
)
def test_a_torn_or_invalid_file_is_measured_over_never_trusted(
    tmp_path: Path, body: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = _open(tmp_path).path
    path.parent.mkdir(parents=True)
    path.write_text(body)
    stored, measure = _open(tmp_path), Measure(8)
    with caplog.at_level(logging.WARNING, logger="agent_mtp.engine.fast"):
        assert stored.get("block_rows", measure, int, whole_number) == 8 and measure.calls == 1
    assert str(path) in caplog.text
    stored.save()
    assert _open(tmp_path).get("block_rows", Measure(1), int, whole_number) == 8  # rewritten


def test_an_unwritable_cache_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder should be")
    stored = _open(blocked)
    stored.get("block_rows", Measure(3), int, whole_number)
    with caplog.at_level(logging.WARNING, logger="agent_mtp.engine.fast"):
        stored.save()
    assert "Could not store the kernel choices" in caplog.text


def test_stored_values_are_checked_when_decoded() -> None:
    assert whole_number(12) == 12 and row_pair([8, 24]) == (8, 24) and row_pair([0, 0]) == (0, 0)
    for bad in (0, -1, 1.5, "3", None, True):
        with pytest.raises(ValueError, match="whole number"):
            whole_number(bad)
    for bad_pair in ([8], [8, -1], [8, 2.0], "8,24", [True, 3]):
        with pytest.raises(ValueError, match="pair"):
            row_pair(bad_pair)


def test_the_cpu_identity_names_the_cpu_not_its_clock() -> None:
    identity = choices.cpu_identity()
    assert identity.endswith(f"cpus={__import__('os').cpu_count()}")
    assert "MHz" not in identity and "bogomips" not in identity
    if Path("/proc/cpuinfo").is_file():
        assert "model name=" in identity and "flags=" in identity
    assert choices.machine_key("a") != choices.machine_key("b") and len(choices.machine_key("a")) == 16


def test_measure_machine_stores_the_cost_curve_that_the_next_engine_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`agent-mtp measure-machine` measures the forward cost curve and stores it under the cache folder, in measure
    mode for the kernel choices; a new engine on the same machine then reads the curve instead of timing passes."""
    from typer.testing import CliRunner

    from agent_mtp import cli
    from tests.unit.test_fast_blockq import _engine

    monkeypatch.setenv("AGENT_MTP_CACHE", str(tmp_path))
    monkeypatch.setenv(CHOICES_ENV, "stored")  # restored after the command sets it for its process
    engine = _engine("plain-llama", adapter=True)
    monkeypatch.setattr(cli, "load_engine", lambda *args: engine)
    result = CliRunner().invoke(cli.app, ["measure-machine", "--model", "tiny"])
    assert result.exit_code == 0, result.output
    assert choices.choices_mode() == "measure"
    stored = list((tmp_path / "cost_curves").glob("*.json"))
    assert len(stored) == 1 and "cost curve stored in" in result.output
    # beside them, what the machine allows a pass (engine/fast/roofline.py): the rates, then the passes both ways
    assert "memory read rate" in result.output and "float32 GEMM rate" in result.output, result.output
    assert "8-token pass at" in result.output and "at the rates" in result.output, result.output
    # draft-only masks have a curve of their own only where the record paths (AMX, VNNI) serve them: not on AVX2
    assert ("draft-only masks" in result.output) == blockq.records_active(), result.output
    assert stored[0] == engine._cost_curve_path()
    # the curve's file names the machine: another CPU sharing the cache folder would measure its own
    with monkeypatch.context() as another_cpu:
        another_cpu.setattr(choices, "cpu_identity", lambda: "vendor_id=Another\ncpus=64")
        assert engine._cost_curve_path() != stored[0] and engine._cost_curve_path().parent == stored[0].parent
    again = _engine("plain-llama", adapter=True)
    monkeypatch.setattr(again, "measure_cost_curve", lambda: pytest.fail("the stored curve was not read"))
    assert again.cost_curve == engine.cost_curve


def test_one_process_measures_at_a_time_and_the_one_that_waited_reads_what_was_stored(tmp_path: Path) -> None:
    """Two preparers of the same cost curve at once (threads here; replicas starting together in a fleet): the
    second waits on the file's lock while the first measures, then reads the stored curve instead of measuring."""
    import threading

    from agent_mtp.engine.cost import CostCurve, load_or_measure

    path = tmp_path / "cost_curves" / "curve.json"
    curve = CostCurve(((1, 1.0), (2, 1.2), (4, 1.7)))
    measuring, release = threading.Event(), threading.Event()
    measured: list[str] = []

    def slow_measure() -> CostCurve:
        measured.append("first")
        measuring.set()
        assert release.wait(10)
        return curve

    got: dict[str, CostCurve] = {}
    first = threading.Thread(target=lambda: got.update(first=load_or_measure(path, slow_measure)))
    first.start()
    assert measuring.wait(10)
    second = threading.Thread(
        target=lambda: got.update(second=load_or_measure(path, lambda: measured.append("second") or curve))
    )
    second.start()
    second.join(0.3)
    assert second.is_alive() and "second" not in got  # waiting on the lock, not measuring
    release.set()
    first.join(10)
    second.join(10)
    assert measured == ["first"] and got["first"] == got["second"] == curve


def test_kernel_choices_are_settled_under_the_files_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``StoredChoices.settling``: a second settler of the same machine, shapes and threads waits for the first and
    reads its stored choice."""
    import threading

    monkeypatch.delenv(CHOICES_ENV, raising=False)
    measuring, release = threading.Event(), threading.Event()
    values: dict[str, int] = {}
    calls: list[str] = []

    def settle(name: str, value: int) -> None:
        def measure() -> int:
            calls.append(name)
            measuring.set()
            assert release.wait(10)
            return value

        with StoredChoices.settling(tmp_path, build="b1", shapes=SHAPES, threads=2) as stored:
            values[name] = stored.get("block_rows", measure, int, whole_number)

    first = threading.Thread(target=settle, args=("first", 12))
    first.start()
    assert measuring.wait(10)
    second = threading.Thread(target=settle, args=("second", 4))
    second.start()
    second.join(0.3)
    assert second.is_alive()
    release.set()
    first.join(10)
    second.join(10)
    assert calls == ["first"] and values == {"first": 12, "second": 12}
