"""
Cross-lingual extractive QA: fine-tune XLM-R large on SQuAD v1.1, evaluate zero-shot on XQuAD.
Sharded with PyTorch FSDP (FULL_SHARD, bf16) and a hand-written loop.

    torchrun --nproc_per_node=8 07_qa_fsdp_xlmr_large.py --output_dir /shared/runs/xlmr-large-squad \
        --eval_langs en de es zh
"""
import argparse
import collections
import functools
import logging
import os

import evaluate
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup
from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaLayer

log = logging.getLogger("xqa")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="xlm-roberta-large")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--eval_langs", nargs="+", default=["en"])
    p.add_argument("--max_len", type=int, default=384)
    p.add_argument("--stride", type=int, default=128)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=1.5e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--n_best", type=int, default=20)
    p.add_argument("--max_answer_len", type=int, default=30)
    return p.parse_args()


def make_train_features(ex, tok, a):
    enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second", max_length=a.max_len,
              stride=a.stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["start_positions"], enc["end_positions"] = [], []
    for i, offs in enumerate(enc.pop("offset_mapping")):
        sid = enc.sequence_ids(i)
        ans = ex["answers"][smap[i]]
        sc = ans["answer_start"][0]
        ec = sc + len(ans["text"][0])
        ctx = [k for k, s in enumerate(sid) if s == 1]
        if offs[ctx[0]][0] > sc or offs[ctx[-1]][1] < ec:
            enc["start_positions"].append(0)
            enc["end_positions"].append(0)
            continue
        enc["start_positions"].append(next(k for k in ctx if offs[k][1] > sc))
        enc["end_positions"].append(next(k for k in reversed(ctx) if offs[k][0] < ec))
    return enc


def make_eval_features(ex, tok, a):
    enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second", max_length=a.max_len,
              stride=a.stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = [ex["id"][j] for j in smap]
    enc["offset_mapping"] = [
        [o if s == 1 else None for o, s in zip(offs, enc.sequence_ids(i))]
        for i, offs in enumerate(enc["offset_mapping"])
    ]
    return enc


def decode_answers(examples, features, logits, a):
    feats = collections.defaultdict(list)
    for i, eid in enumerate(features["example_id"]):
        feats[eid].append(i)
    out = []
    for ex in examples:
        cands = []
        for fi in feats[ex["id"]]:
            st, en = logits[fi]
            offs = features[fi]["offset_mapping"]
            for s in np.argsort(st)[::-1][: a.n_best]:
                for e in np.argsort(en)[::-1][: a.n_best]:
                    if s < len(offs) and e < len(offs) and offs[s] and offs[e] and s <= e < s + a.max_answer_len:
                        cands.append((st[s] + en[e], ex["context"][offs[s][0]: offs[e][1]]))
        out.append({"id": ex["id"], "prediction_text": max(cands)[1] if cands else ""})
    return out


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    mine = []
    for batch in loader:
        ids = batch.pop("fidx").tolist()
        lens = batch["attention_mask"].sum(1).tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        st, en = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
        mine.extend((i, st[j, :lens[j]], en[j, :lens[j]]) for j, i in enumerate(ids))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    model.train()
    return {i: (s, e) for chunk in everyone for i, s, e in chunk}


def save_model(model, tokenizer, out_dir, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        os.makedirs(out_dir, exist_ok=True)
        model.module.save_pretrained(out_dir, state_dict=state)
        tokenizer.save_pretrained(out_dir)
        log.info("saved %s", out_dir)


def main():
    a = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(a.model)
    squad = load_dataset("squad")
    xquad = {lang: load_dataset("xquad", f"xquad.{lang}")["validation"] for lang in a.eval_langs}

    if rank != 0:
        dist.barrier()
    train = squad["train"].map(make_train_features, batched=True, fn_kwargs=dict(tok=tok, a=a),
                               remove_columns=squad["train"].column_names, num_proc=8)
    eval_sets = {}
    for lang, exs in xquad.items():
        feats = exs.map(make_eval_features, batched=True, fn_kwargs=dict(tok=tok, a=a),
                        remove_columns=exs.column_names)
        model_in = feats.remove_columns(["example_id", "offset_mapping"])
        model_in = model_in.add_column("fidx", list(range(len(model_in))))
        eval_sets[lang] = (exs, feats, model_in)
    if rank == 0:
        dist.barrier()

    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    train_dl = DataLoader(train, batch_size=a.bs, sampler=sampler, collate_fn=collator, num_workers=4,
                          pin_memory=True, drop_last=True)
    eval_dls = {
        lang: DataLoader(m, batch_size=64, sampler=DistributedSampler(m, shuffle=False), collate_fn=collator)
        for lang, (_, _, m) in eval_sets.items()
    }

    model = AutoModelForQuestionAnswering.from_pretrained(a.model)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={XLMRobertaLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    total = a.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(a.warmup * total), total)
    squad_metric = evaluate.load("squad")
    log.info("world %d | global batch %d | %d steps", world, world * a.bs, total)

    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        for lang, dl in eval_dls.items():
            logits = run_eval(model, dl, device)
            if rank == 0:
                exs, feats, _ = eval_sets[lang]
                preds = decode_answers(exs, feats, logits, a)
                refs = [{"id": ex["id"], "answers": ex["answers"]} for ex in exs]
                res = squad_metric.compute(predictions=preds, references=refs)
                log.info("epoch %d xquad.%s EM %.2f F1 %.2f", epoch, lang, res["exact_match"], res["f1"])

        save_model(model, tok, os.path.join(a.output_dir, f"epoch{epoch}"), rank)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
