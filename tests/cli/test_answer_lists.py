"""The answers listed under a cause come from one function (catalog.claiming_answers):
best first under a ranked cause (`ask`), in the KB's order in `explain`, advice only in
`doctor`. Checked on made-up threads for the rules, and on the real KB for each command."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from assistant.cli import main
from assistant.config import kb_layers
from assistant.knowledge.catalog import claiming_answers, contract_causes
from assistant.knowledge.kb import load_kb


def answer(answer_id, stance, lang="en", text="fix it", claims=("c",), advice=""):
    return {
        "id": answer_id,
        "text": text,
        "lang": lang,
        "stance": stance,
        "claims": list(claims),
        "advice": advice,
    }


THREADS = [
    {
        "id": "t1",
        "question": "why does it hang?",
        "answers": [
            answer("a1", "wrong", lang="zh"),
            answer("a2", "unverified", advice="set-device-first"),
            answer("a3", "right", claims=("other",)),
        ],
    },
    {
        "id": "t2",
        "answers": [  # a thread without a question (the index's JSON may lack it)
            answer("a1", "partly_right", text="a long answer in English"),
            answer("a2", "right", lang="zh", text="short", advice="spawn"),
            answer("a3", "partly_right", lang="zh", text="longer answer"),
        ],
    },
]


def ids(answers) -> list[str]:
    return [f"{a.thread}#{a.answer_id}" for a in answers]


def test_kb_order_lists_every_claiming_answer_thread_by_thread():
    listed = claiming_answers(THREADS, "c")
    assert ids(listed) == ["t1#a1", "t1#a2", "t2#a1", "t2#a2", "t2#a3"]
    assert listed[0].question == "why does it hang?" and listed[2].question == ""
    assert ids(claiming_answers(THREADS, "other")) == ["t1#a3"]
    assert claiming_answers(THREADS, "nobody") == []


@pytest.mark.parametrize(
    ("lang", "expected"),
    [
        # right and partly right lead, the reader's language first among them,
        # then the finer stance, then the shorter text; wrong comes last in any language
        ("en", ["t2#a1", "t2#a2", "t2#a3", "t1#a2", "t1#a1"]),
        ("zh", ["t2#a2", "t2#a3", "t2#a1", "t1#a2", "t1#a1"]),
    ],
)
def test_best_order_puts_stance_before_language(lang, expected):
    assert ids(claiming_answers(THREADS, "c", order="best", lang=lang)) == expected


def test_advice_only_and_limit():
    assert ids(claiming_answers(THREADS, "c", advice_only=True)) == ["t1#a2", "t2#a2"]
    best = claiming_answers(THREADS, "c", order="best", lang="zh", advice_only=True, limit=1)
    assert ids(best) == ["t2#a2"]
    assert ids(claiming_answers(THREADS, "c", limit=2)) == ["t1#a1", "t1#a2"]


KB = load_kb(kb_layers())


def kb_claims(cause_id: str, advice_only: bool = False) -> list[tuple[str, str, str]]:
    """The oracle: (thread, answer id, text) of the KB files' answers that claim
    `cause_id`, in file order."""
    return [
        (thread.id, each.id, each.text)
        for thread in KB.threads
        for each in thread.answers
        if cause_id in each.claims and (each.advice or not advice_only)
    ]


def keys(answers) -> list[tuple[str, str, str]]:
    return [(a.thread, a.answer_id, a.text) for a in answers]


@pytest.mark.parametrize("cause_id", ["set-device-order", "duplicate-gpu-per-rank"])
def test_explain_lists_every_answer_in_the_kb_order(cause_id):
    result = CliRunner().invoke(main, ["explain", cause_id, "--json"])
    assert result.exit_code == 0, result.output
    listed = [(a["thread"], a["text"]) for a in json.loads(result.stdout)["answers"]]
    expected = [(thread, text) for thread, _id, text in kb_claims(cause_id)]
    assert expected and listed == expected
    if cause_id == "set-device-order":
        assert len(listed) > 6  # more than a ranked cause shows: explain cuts none


def test_doctor_lists_only_the_advice_a_probe_can_settle():
    causes = {cause.id: cause for cause in contract_causes()}
    assert any(kb_claims(cid, advice_only=True) for cid in causes), "advice-tagged answers"
    for cause_id, cause in causes.items():
        assert keys(cause.answers) == kb_claims(cause_id, advice_only=True), cause_id
        assert all(a.advice for a in cause.answers)


@pytest.mark.slow
def test_ask_shows_a_ranked_cause_its_best_answers_first(engine):
    result = engine.ask("DDP 一直报错找不到设备", top=3)
    assert result.lang == "zh"
    for cause in result.causes:
        claimed = kb_claims(cause.id)
        assert len(cause.answers) == min(6, len(claimed))
        assert set(keys(cause.answers)) <= set(claimed)
        group = {"right": 0, "partly_right": 0, "unverified": 1, "wrong": 2}
        order = [(group[a.stance], a.lang != "zh") for a in cause.answers]
        assert order == sorted(order), cause.id


def test_within_a_stance_the_thread_that_asked_the_same_thing_leads():
    threads = [
        {
            "id": "syncbn",
            "question": "SyncBatchNorm on one GPU says the default process group is not initialized",
            "answers": [answer("a1", "right", text="launch with dist_train.sh and 1 GPU")],
        },
        {
            "id": "sampler",
            "question": "DistributedSampler(dataset) raises: default process group not initialized",
            "answers": [
                answer("a1", "right", text="call init_process_group before the sampler first"),
                answer("a2", "wrong", text="reinstall torch"),
            ],
        },
    ]
    query = "DistributedSampler(dataset) fails: Default process group has not been initialized"
    assert ids(claiming_answers(threads, "c", order="best", query=query)) == [
        "sampler#a1",
        "syncbn#a1",
        "sampler#a2",  # a wrong answer stays last, however close its thread
    ]
    # without a question the shorter answer leads, as before
    assert ids(claiming_answers(threads, "c", order="best"))[0] == "syncbn#a1"


def test_the_readers_language_leads_a_closer_thread_in_another():
    """An English question that shares more terms with a Chinese thread's question
    still gets the English answers first (and a Chinese reader the Chinese ones)."""
    threads = [
        {
            "id": "zh-thread",
            "question": "DDP 报错 device_ids 找不到设备 device",
            "answers": [answer("a1", "right", lang="zh", text="先 .cuda(local_rank) 再包 DDP")],
        },
        {
            "id": "en-thread",
            "question": "wrapping the model fails",
            "answers": [answer("a1", "right", text="move the model to its GPU before wrapping")],
        },
    ]
    query = "DDP can't find the device: device_ids error"
    assert ids(claiming_answers(threads, "c", order="best", lang="en", query=query)) == [
        "en-thread#a1",
        "zh-thread#a1",
    ]
    assert ids(claiming_answers(threads, "c", order="best", lang="zh", query=query))[0] == (
        "zh-thread#a1"
    )
