"""The neighbours signal: labelled reports nearest the question vote for their causes."""

from __future__ import annotations

import numpy as np
import pytest

from assistant.clean import clean_log
from assistant.knowledge.neighbours import FLOOR, NEAREST, ReportNeighbours
from assistant.knowledge.reports import example_key


def unit(*values: float) -> np.ndarray:
    vector = np.array(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def three_reports() -> ReportNeighbours:
    vectors = np.vstack([unit(1, 0, 0), unit(0.9, 0.1, 0), unit(0, 0, 1)])
    labels = [("p2p-hang",), ("p2p-hang", "collective-timeout"), ("oom-killed",)]
    return ReportNeighbours(vectors, ["a", "b", "c"], labels)


def test_the_nearest_reports_vote_for_their_causes_and_later_labels_half():
    votes = three_reports().scores(unit(1, 0, 0))
    near = float(unit(0.9, 0.1, 0) @ unit(1, 0, 0))
    assert votes["p2p-hang"] == pytest.approx(1.0 + near)
    assert votes["collective-timeout"] == pytest.approx(0.5 * near)
    assert "oom-killed" not in votes  # orthogonal: under the floor
    assert FLOOR > 0 and NEAREST >= 3


def test_a_held_out_report_never_votes():
    votes = three_reports().scores(unit(1, 0, 0), held_out=frozenset({"a", "b"}))
    assert votes == {}


def test_the_kbs_examples_are_held_for_the_reports_model_and_never_vote():
    vectors = np.vstack([unit(1, 0, 0), unit(1, 0.01, 0), unit(0, 1, 0)])
    keys = ["a", example_key("NCCL hangs"), "c"]
    neighbours = ReportNeighbours(vectors, keys, [("oom-killed",), ("p2p-hang",), ("p2p-hang",)])
    assert neighbours.scores(unit(1, 0, 0)) == {"oom-killed": pytest.approx(1.0)}
    rows = neighbours.rows_for(["c", keys[1], "a"])
    assert np.array_equal(rows, vectors[[2, 1, 0]])
    assert neighbours.rows_for(["a", "never embedded"]) is None


def test_no_reports_no_votes():
    empty = ReportNeighbours(np.zeros((0, 3), dtype=np.float32), [], [])
    assert empty.scores(unit(1, 0, 0)) == {}


class Counting:
    """The real embedder, counting the texts it is asked to embed."""

    def __init__(self, embedder):
        self.embedder = embedder
        self.fingerprint = embedder.fingerprint
        self.embedded: list[str] = []

    def encode(self, texts):
        self.embedded.extend(texts)
        return self.embedder.encode(texts)


REPORTS = [
    ("NCCL hangs in the first all_reduce on 8 GPUs", ("p2p-hang",), "k1"),
    ("the job is killed with exit code -9 while loading data", ("oom-killed",), "k2"),
]


def test_saved_vectors_are_reused_and_only_new_texts_embedded(engine, tmp_path):
    cache = tmp_path / "reports_vectors.npz"
    counting = Counting(engine.embedder)
    first = ReportNeighbours.load_or_embed("set-1", lambda: REPORTS, counting, [cache])
    assert counting.embedded == [text for text, _, _ in REPORTS] and cache.exists()

    def never():
        raise AssertionError("a matching saved set is loaded, not recomputed")

    again = ReportNeighbours.load_or_embed("set-1", never, counting, [cache])
    assert np.array_equal(again.vectors, first.vectors) and again.labels == first.labels
    more = [*REPORTS, ("torchrun says address already in use", ("master-port-in-use",), "k3")]
    counting.embedded.clear()
    grown = ReportNeighbours.load_or_embed("set-2", lambda: more, counting, [cache])
    assert counting.embedded == [more[2][0]]  # the two known texts come from the cache
    assert grown.scores(engine.embedder.encode(["address already in use"])[0])


def test_a_new_build_folder_embeds_nothing_another_folder_of_the_machine_has(engine, tmp_path):
    shared = tmp_path / "user-cache" / "reports_vectors.npz"
    counting = Counting(engine.embedder)
    caches = [tmp_path / "build-1" / "reports_vectors.npz", shared]
    ReportNeighbours.load_or_embed("kb-1", lambda: REPORTS, counting, caches)
    assert len(counting.embedded) == 2 and all(path.exists() for path in caches)
    counting.embedded.clear()
    other = [tmp_path / "build-2" / "reports_vectors.npz", shared]
    # Another KB (another set key), the same report texts: none embedded again.
    again = ReportNeighbours.load_or_embed("kb-2", lambda: REPORTS, counting, other)
    assert counting.embedded == [] and other[0].exists() and again.vectors.shape[0] == 2


def test_a_matching_build_folder_refills_a_missing_user_cache(engine, tmp_path):
    """A build folder made before the user cache existed (or after it was
    cleared) still answers at once, and leaves the next folder its vectors."""
    build, shared = tmp_path / "build" / "reports_vectors.npz", tmp_path / "user" / "r.npz"
    counting = Counting(engine.embedder)
    ReportNeighbours.load_or_embed("kb", lambda: REPORTS, counting, [build])
    assert not shared.exists()

    def never():
        raise AssertionError("the build folder's matching set is read, not recomputed")

    ReportNeighbours.load_or_embed("kb", never, counting, [build, shared])
    assert shared.exists()
    counting.embedded.clear()
    fresh = [tmp_path / "build-2" / "reports_vectors.npz", shared]
    ReportNeighbours.load_or_embed("kb", never, counting, fresh)
    assert counting.embedded == [] and fresh[0].exists()


def test_a_smaller_set_keeps_the_vectors_a_larger_one_embedded(engine, tmp_path):
    """A KB with fewer causes (a team layer, an old revision under `kb eval
    --compare`) saves its set beside the texts others embedded, not over them."""
    shared = tmp_path / "user-cache" / "reports_vectors.npz"
    counting = Counting(engine.embedder)
    ReportNeighbours.load_or_embed("all", lambda: REPORTS, counting, [shared])
    subset = ReportNeighbours.load_or_embed("one", lambda: REPORTS[:1], counting, [shared])
    assert subset.vectors.shape[0] == 1 and subset.labels == [REPORTS[0][1]]
    counting.embedded.clear()
    again = ReportNeighbours.load_or_embed("all-again", lambda: REPORTS, counting, [shared])
    assert counting.embedded == [] and again.vectors.shape[0] == 2


def test_a_well_formed_file_with_damaged_hashes_is_embedded_again(engine, tmp_path):
    from assistant.knowledge.neighbours import read_saved
    from assistant.knowledge.reports import save_arrays

    cache = tmp_path / "reports_vectors.npz"
    header = {"key": str(engine.embedder.fingerprint), "set": "x", "hashes": [["not", "a"], "h"]}
    save_arrays(cache, header, vectors=np.zeros((2, 3), dtype=np.float32))
    assert read_saved(cache, str(engine.embedder.fingerprint)) is None
    counting = Counting(engine.embedder)
    ReportNeighbours.load_or_embed("set", lambda: REPORTS, counting, [cache])
    assert len(counting.embedded) == 2


def test_a_damaged_cache_is_embedded_again_and_an_unwritable_one_is_no_error(engine, tmp_path):
    cache = tmp_path / "reports_vectors.npz"
    cache.write_bytes(b"not an npz file")
    counting = Counting(engine.embedder)
    neighbours = ReportNeighbours.load_or_embed("set", lambda: REPORTS, counting, [cache])
    assert len(counting.embedded) == 2 and neighbours.vectors.shape[0] == 2
    blocked = tmp_path / "file" / "reports_vectors.npz"
    (tmp_path / "file").write_text("a file where a folder should be")
    assert ReportNeighbours.load_or_embed("set", lambda: REPORTS, counting, [blocked]).labels


@pytest.mark.slow
def test_english_questions_get_the_signal_and_chinese_ones_do_not(engine):
    english = engine.signal_scores("DDP training hangs forever at the first barrier on 4 GPUs")
    assert english["neighbours"]
    chinese = engine.signal_scores("四张卡训练时卡在第一个 barrier 不动")
    assert "neighbours" not in chinese and chinese["dense"]


@pytest.mark.slow
def test_a_reply_in_a_conversation_gets_no_votes_of_its_own(engine):
    # The first report's answer, which the reply's ranking is merged with, holds them.
    first = "DDP training hangs forever at the first barrier on 4 GPUs"
    retriever, reply = engine._retriever, clean_log("it still hangs with NCCL_P2P_DISABLE=1")
    in_thread = retriever.signal_scores(reply, context=first, shortcut=False)
    assert "neighbours" not in in_thread and in_thread["dense"]
    assert retriever.signal_scores(reply, shortcut=False)["neighbours"]


@pytest.mark.slow
def test_a_labelled_report_held_out_does_not_find_itself(engine):
    from assistant.knowledge.retrieve import embedded_text

    retriever = engine._retriever
    neighbours = retriever.neighbours
    row = next(i for i, causes in enumerate(neighbours.labels) if causes)
    report = next(
        (text, key) for text, _, key in retriever.reports.labelled() if key == neighbours.keys[row]
    )
    vector = engine.embedder.encode([embedded_text(clean_log(report[0]), retriever.bridge)])[0]
    nearest = neighbours.vectors @ vector
    assert nearest[row] == pytest.approx(1.0, abs=1e-4)  # its own saved vector
    alone = neighbours.scores(vector, held_out=frozenset({report[1]}))
    with_it = neighbours.scores(vector)
    own_cause = neighbours.labels[row][0]
    assert with_it[own_cause] > alone.get(own_cause, 0.0)


def test_a_chinese_question_or_a_reply_never_loads_the_reports_vectors():
    from assistant.knowledge.retrieve import Retriever

    def never():
        raise AssertionError("loading (or first embedding) the reports was not needed")

    retriever = Retriever.__new__(Retriever)  # only what neighbour_scores reads
    retriever._neighbours = never
    vector = unit(1, 0, 0)
    assert retriever.neighbour_scores("四张卡训练时卡在第一个 barrier 不动", vector, None) == {}
    assert retriever.neighbour_scores("it still hangs", vector, "DDP hangs at barrier") == {}


def test_the_neighbours_key_survives_an_install_without_sources(monkeypatch):
    import inspect

    from assistant.knowledge.engine import text_preparation

    assert "def embedded_text" in text_preparation()

    def no_source(_):
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    assert text_preparation()  # a key all the same: the package's version


def test_a_saved_text_gives_its_own_vector_and_any_other_text_none(engine, tmp_path):
    counting = Counting(engine.embedder)
    cache = tmp_path / "reports_vectors.npz"
    embedded = ReportNeighbours.load_or_embed("set", lambda: REPORTS, counting, [cache])
    loaded = ReportNeighbours.load_or_embed("set", list, counting, [cache])
    for neighbours in (embedded, loaded):  # as first embedded, and as read back
        vector = neighbours.vector_of(REPORTS[1][0])
        assert vector is not None and vector.shape == (1, embedded.vectors.shape[1])
        assert np.array_equal(vector[0], embedded.vectors[1])
        assert neighbours.vector_of(REPORTS[1][0] + " ") is None
    assert three_reports().vector_of("a") is None  # made without the texts' hashes


@pytest.mark.slow
def test_a_labelled_report_asked_again_reads_its_saved_vector_not_the_model(engine):
    """`kb eval` asks every labelled report: its vector is the saved one, the
    same the model gives, and the model is not run for it."""
    from assistant.knowledge.retrieve import Retriever, embedded_text

    retriever: Retriever = engine._retriever
    neighbours = retriever.neighbours  # loaded, as after any English question
    text, _, _ = next(iter(retriever.reports.labelled()))
    question = embedded_text(clean_log(text), retriever.bridge)
    counting = Counting(engine.embedder)
    retriever.embedder = counting
    try:
        saved = retriever.query_vector(question)
        fresh = retriever.query_vector(question + " (asked again)")
    finally:
        retriever.embedder = engine.embedder
    assert counting.embedded == [question + " (asked again)"]
    model = engine.embedder.encode([question])
    assert float(saved[0] @ model[0]) == pytest.approx(1.0, abs=1e-5)
    assert neighbours.vector_of(question) is not None and fresh.shape == saved.shape
