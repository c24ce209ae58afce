"""The reports signal: a model of labelled real reports, never scoring a report it learned."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from assistant.config import eval_dir, kb_dir
from assistant.knowledge.evaluate import held_out_groups, load_queries, load_query_sets
from assistant.knowledge.reports import (
    MODEL_FILE,
    POOL_FILE,
    LearnedReports,
    ReportModel,
    ReportPool,
    features,
    gram_matrix,
    read_reports,
    save_arrays,
    text_key,
    weighted,
)

HOLDOUT = eval_dir() / "real_reports_holdout17.jsonl"


@pytest.fixture(scope="module")
def causes(engine) -> list[str]:
    return engine.cause_ids()


@pytest.fixture(scope="module")
def symptoms(engine) -> dict[str, list[str]]:
    return {cid: engine.cause(cid)["symptoms"] for cid in engine.cause_ids()}


@pytest.fixture(scope="module")
def pool(causes) -> ReportPool:
    reports = read_reports(eval_dir())
    known = set(causes)
    return ReportPool.count(
        [(text, causes, text_key(text)) for text, causes in reports if causes[0] in known]
    )


@pytest.fixture
def few_reports(tmp_path, symptoms) -> tuple[Path, dict[str, list[str]]]:
    """Three labelled files and ten causes' symptoms: the saving, loading and
    refitting tests check mechanics, which a pool a fifth the size shows as
    well as the whole one (and each count and fit costs a fifth)."""
    folder = tmp_path / "reports"
    folder.mkdir()
    for name in (HOLDOUT.name, "real_reports_holdout16.jsonl", "real_reports_holdout20.jsonl"):
        shutil.copy(eval_dir() / name, folder / name)
    return folder, {cid: symptoms[cid] for cid in sorted(symptoms)[:10]}


@pytest.mark.parametrize("dense_add", [True, False])
def test_the_split_gram_is_the_plain_sparse_product(pool, dense_add, monkeypatch):
    """Common n-grams multiplied densely, the rest sparsely, and that part added densely
    or entry by entry: the same x @ x.T."""
    monkeypatch.setattr("assistant.knowledge.reports.DENSE_PRODUCT_SHARE", 0 if dense_add else 2)
    from scipy.sparse import csr_matrix, hstack
    from scipy.sparse import random as sparse_random

    rng = np.random.default_rng(0)
    everywhere = csr_matrix(rng.random((300, 5)))  # columns in every row: the dense block
    rare = sparse_random(300, 400, density=0.02, format="csr", random_state=rng)
    synthetic = hstack([everywhere, rare])
    columns, idf = pool._vocabulary(pool.counts)
    real = ReportPool._weighted(pool.counts[:, columns], idf, pool.is_word[columns])[:400]
    for x in (synthetic.tocsr(), real):
        assert np.allclose(gram_matrix(x), (x @ x.T).toarray(), rtol=0, atol=1e-12)


def held_out_keys(path: Path) -> frozenset[str]:
    return frozenset(text_key(item["query"]) for item in load_queries(path))


def test_a_held_out_set_is_fitted_as_if_it_had_never_been_labelled(pool, causes):
    """Holding a set out equals a pool built without it: nothing of it is learned
    (not its labels, not its n-grams' document counts)."""
    held = held_out_keys(HOLDOUT)
    assert held <= pool.key_set  # the set is in the pool, so holding it out matters
    without = ReportPool.count(
        [
            (text, labels, text_key(text))
            for text, labels in read_reports(eval_dir())
            if text_key(text) not in held and labels[0] in causes
        ]
    )
    query = load_queries(HOLDOUT)[0]["query"]
    fitted, rebuilt, full = pool.fit(held), without.fit(), pool.fit()
    assert fitted.vocabulary == rebuilt.vocabulary
    a, b = fitted.scores(query), rebuilt.scores(query)
    assert a.keys() == b.keys()
    assert all(abs(a[c] - b[c]) < 1e-6 for c in a)
    assert full.vocabulary != fitted.vocabulary  # the whole pool is another model


def test_a_query_is_weighted_exactly_as_the_reports_the_model_learned_from(pool):
    """The query path (one Counter, numpy) and the fit (a sparse matrix) compute
    the same tf-idf vector: two implementations that must never drift apart."""
    columns, idf = pool._vocabulary(pool.counts)
    matrix = ReportPool._weighted(pool.counts[:, columns], idf, pool.is_word[columns])
    vocabulary = {pool.terms[c]: j for j, c in enumerate(columns.tolist())}
    words = int(pool.is_word[columns].sum())
    for row, text in list(enumerate(read_texts()))[:40]:
        found, values = weighted(features(text), vocabulary, idf, words)
        dense = np.zeros(len(columns))
        dense[found] = values
        assert np.allclose(dense, matrix[row].toarray()[0]), row


def unit_rows(matrix: np.ndarray) -> np.ndarray:
    return (matrix / np.linalg.norm(matrix, axis=1, keepdims=True)).astype(np.float32)


def test_a_held_out_set_leaves_its_vectors_out_too(pool, causes):
    """The vector block is sliced with the rows: holding a set out equals a pool
    built without it, each text keeping its own vector."""
    held = held_out_keys(HOLDOUT)
    vectors = unit_rows(np.random.default_rng(1).normal(size=(len(pool.keys), 16)))
    kept = [row for row, key in enumerate(pool.keys) if key not in held]
    without = ReportPool(
        [pool.labels[r] for r in kept],
        [pool.keys[r] for r in kept],
        pool.terms,
        pool.counts[kept],
        [pool.also[r] for r in kept],
    )
    query = load_queries(HOLDOUT)[0]["query"]
    vector = vectors[0]
    fitted, rebuilt = pool.fit(held, vectors), without.fit(vectors=vectors[kept])
    a, b = fitted.scores(query, vector), rebuilt.scores(query, vector)
    assert all(abs(a[c] - b[c]) < 1e-4 for c in a)
    assert fitted.vector_weights.shape == (16, len(fitted.causes))


def test_the_questions_vector_pulls_toward_the_causes_of_the_reports_it_lies_near(pool):
    """Vectors that say each report's cause (one direction per cause): a question
    whose words say nothing is ranked by where its vector points."""
    index = {cause: k for k, cause in enumerate(sorted(set(pool.labels)))}
    vectors = np.zeros((len(pool.keys), len(index)), dtype=np.float32)
    vectors[np.arange(len(pool.keys)), [index[label] for label in pool.labels]] = 1.0
    model = pool.fit(vectors=vectors)
    words = "it does not work, please help"
    for cause in ("oom-killed", "windows-libuv", "state-dict-module-prefix"):
        pointing = np.zeros(len(index), dtype=np.float32)
        pointing[index[cause]] = 1.0
        scores = model.scores(words, pointing)
        assert max(scores, key=scores.get) == cause
        assert scores[cause] > model.scores(words)[cause]  # without a vector: n-grams only
    other_model = np.ones(len(index) + 1, dtype=np.float32)  # another embedding model's size
    assert model.scores(words, other_model) == model.scores(words)


def test_a_model_with_vectors_is_saved_and_read_back_with_them(tmp_path, pool):
    vectors = unit_rows(np.random.default_rng(2).normal(size=(len(pool.keys), 8)))
    text, vector = "NCCL timeout on rank 3", vectors[5]
    for fitted in (pool.fit(vectors=vectors), pool.fit()):
        path = tmp_path / MODEL_FILE
        assert fitted.save(path, "key")
        saved = ReportModel.load(path, "key")
        assert (saved.vector_weights is None) == (fitted.vector_weights is None)
        a, b = fitted.scores(text, vector), saved.scores(text, vector)
        assert all(abs(a[c] - b[c]) < 1e-4 for c in a)


def test_the_engines_model_learned_the_embedding_models_vectors(engine):
    """A real build: the labelled reports and the KB's symptoms embedded, the
    block learned, and the saved model keyed by the embedding model."""
    learned = engine._retriever.reports
    model = learned.model()
    assert model.vector_weights is not None
    assert model.vector_weights.shape[1] == len(model.causes)
    assert learned.pool_vectors.shape == (len(learned.pool().keys), model.vector_weights.shape[0])
    assert engine.embedder.fingerprint in learned.model_key()


def test_where_a_signature_names_the_root_error_or_for_a_reply_the_vector_is_not_read(engine):
    """No signal reads the question's vector where a signature named the root
    error (retrieve.needs_dense), so an evaluation, which embeds every
    question, ranks as `ask` does."""
    from assistant.clean import clean_log
    from assistant.knowledge.retrieve import question_text, reports_text

    learned, retriever = engine._retriever.reports, engine._retriever
    named = "RuntimeError: Address already in use\ntorchrun failed to start"
    vague = "DDP training hangs on two GPUs and works on one"
    for question, reads_vector in ((named, False), (vague, True)):
        clean = clean_log(question)
        vector = retriever.query_vector(retriever.bridge.expand(question_text(clean)))
        expected = learned.scores(reports_text(clean), vector=vector if reads_vector else None)
        got = engine.signal_scores(question)["reports"]
        assert all(abs(got[c] - expected[c]) < 1e-5 for c in expected), question
    # A reply in a conversation neither: the first report's answer holds what
    # the labelled reports say (as for the neighbours signal).
    clean = clean_log(vague)
    reply = retriever.signal_scores(clean, context="GPU 0 uses more memory", shortcut=False)
    expected = learned.scores(reports_text(clean))
    assert all(abs(reply["reports"][c] - expected[c]) < 1e-5 for c in expected)


def read_texts() -> list[str]:
    return [text for text, _ in read_reports(eval_dir())]


def test_a_report_it_learned_is_recognised_and_one_held_out_is_not_memorised(pool):
    """The reason evaluation must hold sets out: the full model knows its own reports."""
    item = next(i for i in load_queries(HOLDOUT) if i["causes"][0] in pool.labels)
    full, held = pool.fit(), pool.fit(frozenset({text_key(item["query"])}))
    best = lambda scores: max(scores, key=scores.get)
    assert best(full.scores(item["query"])) == item["causes"][0]
    assert (
        full.scores(item["query"])[item["causes"][0]]
        > held.scores(item["query"])[item["causes"][0]]
    )


def test_a_reports_later_labels_are_learned_as_causes_it_also_fits(pool):
    """A report labelled [A, B] teaches that its words go with B as well (ALSO_TARGET),
    not against it as with every cause it does not fit."""
    row = next(i for i, also in enumerate(pool.also) if also and also[0] in pool.labels)
    second = pool.also[row][0]
    text = next(t for t in read_texts() if text_key(t) == pool.keys[row])
    plain = ReportPool(pool.labels, pool.keys, pool.terms, pool.counts)  # first causes only
    assert plain.fit().scores(text)[second] < pool.fit().scores(text)[second]


def test_kb_eval_holds_out_each_file_while_it_is_scored(engine):
    """evaluate() scores each labelled file with the model fitted without that file."""
    paths = [HOLDOUT, eval_dir() / "real_reports_holdout16.jsonl"]
    queries = load_query_sets(paths)
    retriever = engine._retriever
    seen = []
    for rows in held_out_groups(engine, queries):
        keys = {text_key(queries[row]["query"]) for row in rows}
        assert retriever.held_out == keys
        seen.append({queries[row]["set"] for row in rows})
    assert seen == [{"real_reports_holdout17"}, {"real_reports_holdout16"}]
    assert retriever.held_out == frozenset()  # ask after an evaluation uses the whole pool


def test_the_signal_ranks_the_causes_of_ask(engine):
    result = engine.ask("训练的时候 0 号卡显存比其他卡多很多, 其他进程也出现在 0 号卡上")
    assert all("reports" in cause.signals for cause in result.causes)


def test_the_saved_model_scores_as_the_fitted_one_and_a_stale_or_damaged_file_is_refitted(
    tmp_path, few_reports
):
    folder, symptoms = few_reports
    learned = LearnedReports([folder], [tmp_path / MODEL_FILE], symptoms)
    fitted = learned.model()
    assert (tmp_path / MODEL_FILE).is_file()
    again = LearnedReports([folder], [tmp_path / MODEL_FILE], symptoms)
    key = again.files_key()
    saved = ReportModel.load(tmp_path / MODEL_FILE, key)
    text = "NCCL timeout on rank 3 after the first epoch, training hangs"
    a, b = fitted.scores(text), saved.scores(text)
    assert all(abs(a[c] - b[c]) < 1e-4 for c in a)
    assert ReportModel.load(tmp_path / MODEL_FILE, "another pool") is None
    (tmp_path / MODEL_FILE).write_bytes(b"not a model")
    assert ReportModel.load(tmp_path / MODEL_FILE, key) is None
    assert LearnedReports([folder], [tmp_path / MODEL_FILE], symptoms).model() is not None


def test_the_counted_pool_is_saved_and_a_stale_or_damaged_one_is_counted_again(
    tmp_path, few_reports, monkeypatch
):
    """`kb eval` fits from the saved pool instead of counting every report again."""
    folder, symptoms = few_reports
    learned = LearnedReports([folder], [tmp_path / MODEL_FILE], symptoms)
    counted = learned.pool()
    assert (tmp_path / POOL_FILE).is_file()
    key = learned.files_key()
    saved = ReportPool.load(tmp_path / POOL_FILE, key)
    assert (saved.labels, saved.also, saved.keys, saved.terms) == (
        counted.labels,
        counted.also,
        counted.keys,
        counted.terms,
    )
    assert (saved.counts != counted.counts).nnz == 0 and (saved.is_word == counted.is_word).all()
    held = held_out_keys(HOLDOUT)
    text = "NCCL timeout on rank 3 after the first epoch, training hangs"
    a, b = saved.fit(held).scores(text), counted.fit(held).scores(text)
    assert all(abs(a[c] - b[c]) < 1e-9 for c in a)

    def no_count(*args, **kwargs):
        raise AssertionError("counted again: the saved pool's key did not match")

    with monkeypatch.context() as patched:
        patched.setattr(ReportPool, "count", no_count)
        again = LearnedReports([folder], [tmp_path / MODEL_FILE], symptoms)
        assert again.pool().labels == counted.labels
    assert ReportPool.load(tmp_path / POOL_FILE, "another pool") is None
    whole = (tmp_path / POOL_FILE).read_bytes()
    for damaged in (b"not a pool", whole[: len(whole) // 2], whole[:-9] + b"123456789"):
        (tmp_path / POOL_FILE).write_bytes(damaged)
        assert ReportPool.load(tmp_path / POOL_FILE, key) is None
    # A header whose later labels are not cause ids, under the right key.
    bad_also = [[["nested"]] for _ in counted.labels]
    arrays = {
        "data": counted.counts.data,
        "indices": counted.counts.indices,
        "indptr": counted.counts.indptr,
    }
    header = {
        "key": key,
        "labels": counted.labels,
        "also": bad_also,
        "keys": counted.keys,
        "terms": counted.terms,
    }
    assert save_arrays(tmp_path / POOL_FILE, header, **arrays)
    assert ReportPool.load(tmp_path / POOL_FILE, key) is None
    again = LearnedReports([folder], [tmp_path / MODEL_FILE], symptoms)
    assert again.pool().labels == counted.labels  # counted again, and saved again
    assert ReportPool.load(tmp_path / POOL_FILE, key) is not None


def test_an_unwritable_build_folder_saves_to_the_next_cache(tmp_path, few_reports):
    folder, symptoms = few_reports
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    cache = tmp_path / "cache" / MODEL_FILE
    learned = LearnedReports([folder], [blocked / MODEL_FILE, cache], symptoms)
    assert learned.model() is not None
    assert cache.is_file()


def test_foreign_lines_and_unknown_causes_in_the_pool_are_passed_over(tmp_path, symptoms):
    folder = tmp_path / "eval"
    folder.mkdir()
    shutil.copy(HOLDOUT, folder)
    (folder / "other_team.jsonl").write_text(
        "not json\n"
        '{"query": 3, "causes": ["p2p-hang"]}\n'
        '{"id": "x", "causes": ["p2p-hang"]}\n'
        '{"query": "a hang", "causes": [7]}\n'
        '{"query": "a hang", "causes": "p2p-hang"}\n'
        '{"query": "a hang", "causes": ["p2p-hang", 7, ["deep"]]}\n'
        '{"query": "a report of a cause this KB lacks", "causes": ["no-such-cause"]}\n'
        + "[" * 10_000
        + "\n",
        encoding="utf-8",
    )
    (folder / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    reports = read_reports(folder)
    assert len(reports) == len(load_queries(HOLDOUT)) + 2
    assert ("a hang", ("p2p-hang",)) in reports  # the label that is a cause id, alone
    learned = LearnedReports([folder], [tmp_path / MODEL_FILE], symptoms)
    assert "no-such-cause" not in learned.pool().labels
    assert learned.model() is not None


def test_no_labelled_reports_means_no_signal(tmp_path, symptoms):
    learned = LearnedReports([tmp_path / "missing"], [tmp_path / MODEL_FILE], symptoms)
    assert learned.model() is None
    assert learned.scores("DDP hangs") == {}


def test_a_cause_no_labelled_report_names_is_learned_from_its_symptoms(symptoms, tmp_path):
    """A new or a team's own cause has no reports yet; its KB symptoms speak for it.

    Every built-in cause is the first label of some report by now (holdout31
    gave the last two, too-many-open-files and process-group-not-destroyed,
    their first), so the labelled files are copied without the reports that
    name the least reported cause, as they stood before its first report.
    """
    counts: dict[str, int] = {}
    for _, labels in read_reports(eval_dir()):
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
    cause = min((c for c in sorted(symptoms) if symptoms[c]), key=lambda c: counts.get(c, 0))
    reports = tmp_path / "reports"
    reports.mkdir()
    for path in sorted(eval_dir().glob("*.jsonl")):
        kept = [
            line
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and cause not in json.loads(line).get("causes", [])
        ]
        (reports / path.name).write_text("\n".join(kept) + "\n", encoding="utf-8")
    assert all(cause not in labels for _, labels in read_reports(reports))
    model = LearnedReports([reports], [tmp_path / MODEL_FILE], symptoms).model()
    scores = model.scores(symptoms[cause][0])
    assert cause in sorted(scores, key=scores.get, reverse=True)[:3]


def test_an_engine_on_a_built_index_reads_the_saved_model_and_fits_nothing(
    engine, build_dir, monkeypatch
):
    """kb build fits and saves; the next process's question only loads it."""
    from assistant.knowledge.engine import Engine

    def no_fit(*args, **kwargs):
        raise AssertionError("fitted again: the saved model's key did not match")

    monkeypatch.setattr(ReportPool, "fit", no_fit)
    monkeypatch.setattr(ReportPool, "count", no_fit)
    fresh = Engine(
        index_path=build_dir / "index.sqlite", log=lambda m: None, embedder=engine.embedder
    )
    result = fresh.ask("NCCL watchdog timeout on rank 2 after 30 minutes, job killed")
    assert all("reports" in cause.signals for cause in result.causes)
    # kb eval's held-out fits start from the pool kb build counted and saved
    monkeypatch.undo()
    monkeypatch.setattr(ReportPool, "count", no_fit)
    with fresh.holding_out([load_queries(HOLDOUT)[0]["query"]]):
        assert fresh.ask("NCCL watchdog timeout on rank 2").causes


def test_a_team_layers_reports_join_the_pool_and_refit_the_model(engine, mini_kb, tmp_path):
    """`assistant kb feedback --export <layer>/reports/x.jsonl`, then the next
    question learns from the answers the team confirmed."""
    from assistant.knowledge.engine import Engine

    team = Engine(
        kb_root=[kb_dir(), mini_kb],
        index_path=tmp_path / "build" / "index.sqlite",
        log=lambda m: None,
        embedder=engine.embedder,
    )
    symptoms = {cid: engine.cause(cid)["symptoms"] for cid in engine.cause_ids()}
    before = team.learned_reports(symptoms)
    size, key = len(before.pool().labels), before.files_key()
    (mini_kb / "reports").mkdir()
    ticket = {
        "id": "feedback-1",
        "query": "our cluster: rank 5 hangs in allreduce",
        "causes": ["p2p-hang"],
    }
    (mini_kb / "reports" / "tickets.jsonl").write_text(json.dumps(ticket) + "\n", encoding="utf-8")
    after = team.learned_reports(symptoms)
    assert len(after.pool().labels) == size + 1
    assert after.files_key() != key  # a saved model of the old pool is not reused
