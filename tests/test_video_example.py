"""examples/video_tracking.py: the tracker recovers the generated objects from the decoded clip
(count, entry side and time, paths, exits, directions), and the example streams its text frames
into a session end to end."""

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest


def _load_example():
    path = Path(__file__).resolve().parent.parent / "examples" / "video_tracking.py"
    spec = importlib.util.spec_from_file_location("video_tracking", path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class is built
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


vt = _load_example()

# The direction words as unit vectors (image coordinates: y grows downwards).
UNIT = {word: (math.cos(k * math.pi / 4), math.sin(k * math.pi / 4)) for k, word in enumerate(vt._DIRECTIONS)}


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return vt.make_clip(tmp_path_factory.mktemp("video") / "clip.mp4", seconds=10, fps=10)


@pytest.fixture(scope="module")
def tracked(clip):
    records = vt.track(clip.path)
    tracks = vt.summarize(records)
    # Each track to the object it follows: the one whose truth path is nearest its points.
    pairs = {}
    for track_id, summary in tracks.items():
        errors = {}
        for obj in clip.objects:
            positions = [obj.position(t) for t, _, _ in summary.points]
            if None not in positions:
                errors[obj.id] = max(math.dist((x, y), p) for (_, x, y), p in zip(summary.points, positions))
        pairs[track_id] = min(errors, key=errors.get) if errors else None
    return records, tracks, pairs


def test_clip_is_a_real_video_with_known_objects(clip):
    assert clip.path.exists() and clip.path.stat().st_size > 10_000
    assert clip.frames == 100
    assert len(clip.objects) == 4
    sides = {(o.enter_side, o.exit_side) for o in clip.objects}
    assert sides == {("left", "right"), ("top", "bottom"), ("right", "left"), ("bottom", "right")}
    # No two objects come close enough to merge into one blob.
    for i, a in enumerate(clip.objects):
        for b in clip.objects[i + 1 :]:
            for k in range(1000):
                pa, pb = a.position(k / 100), b.position(k / 100)
                if pa and pb:
                    assert math.dist(pa, pb) > 2 * (a.size + b.size), (a.name, b.name, k / 100)


def test_one_track_per_object(clip, tracked):
    records, tracks, pairs = tracked
    assert len(records) == clip.frames
    assert len(tracks) == len(clip.objects)
    assert sorted(pairs.values()) == sorted(o.id for o in clip.objects)


def test_entries_and_exits_match_the_truth(clip, tracked):
    _, tracks, pairs = tracked
    objects = {o.id: o for o in clip.objects}
    for track_id, summary in tracks.items():
        obj = objects[pairs[track_id]]
        first, last = obj.visible_span()
        assert summary.entered == obj.enter_side, obj.name
        # Found once enough of it shows (some pixels before its centre crosses the edge), at frame times.
        assert abs(summary.first_t - first) <= 0.3, (obj.name, summary.first_t, first)
        if last < 10 - 0.5:  # left the frame with time to spare before the clip ends
            assert summary.exited == obj.exit_side, obj.name
            assert abs(summary.last_t - last) <= 0.3, (obj.name, summary.last_t, last)


def test_centroids_follow_the_paths(clip, tracked):
    _, tracks, pairs = tracked
    objects = {o.id: o for o in clip.objects}
    worst_inside = 0.0
    for track_id, summary in tracks.items():
        obj = objects[pairs[track_id]]
        assert len(summary.points) >= 20, obj.name
        for t, x, y in summary.points:
            px, py = obj.position(t)
            error = math.dist((x, y), (px, py))
            # Cut by the frame's edge, the visible part's centroid sits up to half the object inward.
            assert error <= obj.size, (obj.name, t, error)
            if obj.size + 2 <= px < clip.width - obj.size - 2 and obj.size + 2 <= py < clip.height - obj.size - 2:
                worst_inside = max(worst_inside, error)
    assert worst_inside <= 2.5


def test_directions_follow_the_paths(clip, tracked):
    records, _, pairs = tracked
    objects = {o.id: o for o in clip.objects}
    checked = 0
    for record in records:
        for s in record.seen:
            if s.direction is None:
                continue
            vx, vy = objects[pairs[s.id]].velocity(record.t)
            ux, uy = UNIT[s.direction]
            # Within one compass sector of the true heading, which turns along the curved path.
            assert (ux * vx + uy * vy) / math.hypot(vx, vy) > math.cos(3 * math.pi / 8), (s, record.t)
            checked += 1
    assert checked > 100


def test_text_frames_and_tracker_answers(tracked):
    records, _, _ = tracked
    frames = vt.subsample(records, 2)
    assert [r.index for r in frames] == list(range(0, 100, 2))
    # Subsampling keeps every entry and exit.
    assert sorted(e for r in frames for e in r.entered) == sorted(e for r in records for e in r.entered)
    assert sorted(e for r in frames for e in r.exited) == sorted(e for r in records for e in r.exited)

    record = vt.FrameRecord(
        124,
        12.4,
        (vt.Seen(3, 220, 140, "right"), vt.Seen(5, 4, 90, None)),
        entered=((5, "left"),),
        exited=((2, "top"),),
    )
    assert vt.describe(record) == (
        "t=12.4s: id 3 at (220,140) moving right; id 5 entered from left at (4,90); id 2 exited at top"
    )
    assert vt.describe(vt.FrameRecord(0, 0.0, ())) == "t=0.0s: nothing in view"

    history = [vt.FrameRecord(120, 12.0, (vt.Seen(3, 200, 140, "right"),), entered=((3, "left"),)), record]
    assert vt.answer_truth(vt.Question("in_view"), history) == "3, 5"
    assert vt.answer_truth(vt.Question("enter", 5), history) == "left"
    assert vt.answer_truth(vt.Question("enter", 3), history) == "left"
    assert vt.answer_truth(vt.Question("direction", 3), history) == "right"
    assert vt.agrees(vt.Question("in_view"), "Ids 5 and 3 are in view.", "3, 5")
    assert not vt.agrees(vt.Question("in_view"), "Only id 3.", "3, 5")
    assert vt.agrees(vt.Question("direction", 3), "It is moving right.", "right")
    assert not vt.agrees(vt.Question("direction", 3), "It is moving up-right.", "right")


@pytest.mark.slow
def test_streams_the_clip_into_a_session(tmp_path):
    from kvbank import LLM

    clip = vt.make_clip(tmp_path / "clip.mp4", seconds=2, fps=10)
    frames = vt.subsample(vt.track(clip.path), 1)
    assert len(frames) == 20
    lines = []
    llm = LLM()
    try:
        asked, final = vt.run_stream(llm, frames, frames_kept=8, ask_every=0.5, max_tokens=16, out=lines.append)
        # A clip shorter than the interval between questions still gets one, at its last frame.
        once, _ = vt.run_stream(llm, frames, frames_kept=8, ask_every=5.0, max_tokens=16, out=lambda line: None)
    finally:
        llm.close()
    assert [a.t for a in once] == [frames[-1].t] and once[0].model
    assert [a.t for a in asked] == pytest.approx([0.5, 1.0, 1.5])
    assert [a.question.kind for a in asked] == ["in_view", "enter", "direction"]
    for a in asked:
        assert isinstance(a.model, str) and a.model
        assert a.stats["kept_frames"] <= 8
    assert final["frames"] == 20
    assert final["kept_frames"] == 8
    assert final["evicted_frames"] == 12
    # From the eighth frame on the session holds eight, however many more arrive.
    assert sum("kept 8 frames" in line for line in lines) == 20 - 7


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exited:
        vt.main(["--help"])
    assert exited.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "seconds of video between questions (default 2;" in help_text
    for flag in ("--seconds", "--fps", "--frames-kept", "--every", "--ask-every"):
        assert re.search(re.escape(flag) + r" [A-Z_]+\s+[^-]*\(default ", help_text), flag
