"""The run's events: appended to metrics.jsonl, read back by a restarted coordinator, written as
TensorBoard scalars; and the page's curves made from them."""

import json

from diloco.observe.events import METRICS_LOG, RunEvents, read_events, scalars
from diloco.observe.http import downsample, history
from tests.support import FakeClock


def test_events_go_to_the_file_and_a_restart_reads_them_back(tmp_path) -> None:
    clock = FakeClock()
    first = RunEvents(tmp_path, clock=clock, tensorboard=False)
    first.record("start", epoch=1)
    clock.advance(5)
    first.record("merge", fragment=0, version=1, mean_loss=4.0, tokens_merged=100)
    first.close()
    (tmp_path / METRICS_LOG).open("a").write('{"kind": "merge", "at": 9, "cut short')  # a kill mid-line
    again = RunEvents(tmp_path, clock=clock, tensorboard=False)
    again.record("start", epoch=2)
    assert [e["kind"] for e in again.recent()] == ["start", "merge", "start"]
    assert [e.get("epoch") for e in again.recent(["start"])] == [1, 2]
    again.close()
    lines = (tmp_path / METRICS_LOG).read_text().splitlines()
    assert json.loads(lines[1]) == {
        "kind": "merge",
        "at": 1005.0,
        "fragment": 0,
        "version": 1,
        "mean_loss": 4.0,
        "tokens_merged": 100,
    }
    assert len(read_events(tmp_path / METRICS_LOG)) == 3  # the cut line is skipped


def test_scalars_are_stepped_by_the_tokens_merged() -> None:
    assert list(scalars({"kind": "merge", "mean_loss": 3.5, "tokens_merged": 640})) == [
        ("train/round_loss", 3.5, 640)
    ]
    evaluated = {"kind": "eval", "loss": 2.0, "metrics": {"accuracy": 0.9}, "tokens_merged": 10}
    assert list(scalars(evaluated)) == [("eval/loss", 2.0, 10), ("eval/accuracy", 0.9, 10)]
    assert list(scalars({"kind": "join", "worker_id": "w"})) == []


def test_the_tensorboard_files_hold_the_curves(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = RunEvents(tmp_path)
    for v in range(1, 4):
        events.record("merge", fragment=0, version=v, mean_loss=5.0 - v, tokens_merged=100 * v)
    events.close()
    board = EventAccumulator(str(events.directory / "tensorboard"))
    board.Reload()
    assert [(s.step, s.value) for s in board.Scalars("train/round_loss")] == [
        (100, 4.0),
        (200, 3.0),
        (300, 2.0),
    ]


def test_curves_are_downsampled_keeping_both_ends_and_the_timeline_holds_restarts() -> None:
    points = [[float(i), float(i)] for i in range(1000)]
    kept = downsample(points, 50)
    assert len(kept) == 50 and kept[0] == points[0] and kept[-1] == points[-1]
    events = [{"kind": "start", "at": 0.0, "epoch": 1}]
    events += [
        {"kind": "learner", "at": float(t), "worker_id": f"l{t % 64}", "loss": 3.0} for t in range(20_000)
    ]
    events += [{"kind": "chunk_failed", "at": 5.0, "chunk": 3, "quarantined": False}]
    events += [{"kind": "chunk_failed", "at": 6.0, "chunk": 4, "quarantined": True, "error": "bad"}]
    h = history(events, max_points=100)
    assert len(h["learner_loss"]) == 64 and all(len(p) <= 100 for p in h["learner_loss"].values())
    assert [(e["kind"], e.get("chunk")) for e in h["timeline"]] == [("start", None), ("chunk_failed", 4)]


def test_the_tail_is_read_backwards_and_matches_the_whole_file(tmp_path) -> None:
    # A restarted coordinator reads only the tail of a week's log; blocks of 7 bytes cut lines
    # anywhere, and what comes back must be the same last lines a full read gives.
    from diloco.observe.events import _tail_lines

    path = tmp_path / METRICS_LOG
    lines = [json.dumps({"kind": "merge", "at": i, "pad": "x" * (i % 5)}) for i in range(40)]
    path.write_text("\n".join(lines) + "\n" + '{"kind": "merge", "cut')  # a kill mid-line last
    whole = path.read_bytes().splitlines()
    for last in (0, 1, 2, 5, 40, 41, 100):
        for block in (1, 7, 64, 1 << 20):
            assert _tail_lines(path, last, block) == whole[len(whole) - min(last, len(whole)) :], (
                last,
                block,
            )
    assert [e["at"] for e in read_events(path, last=3)] == [38, 39]  # the cut line counts, then is skipped
    assert len(read_events(path)) == 40
