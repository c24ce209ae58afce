#!/usr/bin/env python
"""SQuAD 2.0 with roberta-large under FSDP (FULL_SHARD, bf16 params), custom training loop.

    torchrun --nproc_per_node=8 18_qa_fsdp_roberta_large.py --output_dir /shared/ckpt/rl-squad2-fsdp
"""
import argparse
import collections
import functools
import json
import logging
import os

import evaluate
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
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
from transformers.models.roberta.modeling_roberta import RobertaLayer

logger = logging.getLogger("squad2-fsdp")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="roberta-large")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_len", type=int, default=384)
    p.add_argument("--stride", type=int, default=128)
    p.add_argument("--bs", type=int, default=12)
    p.add_argument("--lr", type=float, default=1.5e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup", type=float, default=0.06)
    p.add_argument("--n_best", type=int, default=20)
    p.add_argument("--max_answer_len", type=int, default=30)
    p.add_argument("--null_threshold", type=float, default=0.0)
    return p.parse_args()


def train_features(ex, tok, a):
    enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second",
              max_length=a.max_len, stride=a.stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["start_positions"], enc["end_positions"] = [], []
    for i, offs in enumerate(enc.pop("offset_mapping")):
        ans = ex["answers"][smap[i]]
        ctx = [k for k, s in enumerate(enc.sequence_ids(i)) if s == 1]
        if not ans["answer_start"]:
            enc["start_positions"].append(0)
            enc["end_positions"].append(0)
            continue
        sc = ans["answer_start"][0]
        ec = sc + len(ans["text"][0])
        if offs[ctx[0]][0] > sc or offs[ctx[-1]][1] < ec:
            enc["start_positions"].append(0)
            enc["end_positions"].append(0)
            continue
        enc["start_positions"].append(next(k for k in ctx if offs[k][1] > sc))
        enc["end_positions"].append(next(k for k in reversed(ctx) if offs[k][0] < ec))
    return enc


def eval_features(ex, tok, a):
    enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second",
              max_length=a.max_len, stride=a.stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = [ex["id"][j] for j in smap]
    enc["offset_mapping"] = [[o if s == 1 else None for o, s in zip(offs, enc.sequence_ids(i))]
                             for i, offs in enumerate(enc["offset_mapping"])]
    return enc


def postprocess(examples, features, logits, a):
    groups = collections.defaultdict(list)
    for i, eid in enumerate(features["example_id"]):
        groups[eid].append(i)
    preds = []
    for ex in examples:
        best_text, best_score, null_score = "", -np.inf, np.inf
        for fi in groups[ex["id"]]:
            st, en = logits[fi]
            null_score = min(null_score, st[0] + en[0])
            offs = features[fi]["offset_mapping"]
            for s in np.argsort(st)[::-1][: a.n_best]:
                for e in np.argsort(en)[::-1][: a.n_best]:
                    if s >= len(offs) or e >= len(offs) or offs[s] is None or offs[e] is None:
                        continue
                    if e < s or e - s + 1 > a.max_answer_len:
                        continue
                    if st[s] + en[e] > best_score:
                        best_score, best_text = st[s] + en[e], ex["context"][offs[s][0]:offs[e][1]]
        answer = best_text if best_score - null_score > a.null_threshold else ""
        preds.append({"id": ex["id"], "prediction_text": answer, "no_answer_probability": 0.0})
    return preds


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    rows = []
    for batch in loader:
        fidx = batch.pop("fidx").tolist()
        lens = batch["attention_mask"].sum(1).tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        st, en = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
        rows.extend((f, st[j, :lens[j]], en[j, :lens[j]]) for j, f in enumerate(fidx))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    model.train()
    return {f: (s, e) for part in parts for f, s, e in part}


def save_full(model, optimizer, tok, out_dir, rank):
    # every rank has to enter the state_dict calls: they all-gather the shards
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, optim_cfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        model.module.save_pretrained(out_dir, state_dict=model_state, safe_serialization=True)
        tok.save_pretrained(out_dir)
        torch.save(optim_state, os.path.join(out_dir, "optimizer.pt"))
    dist.barrier()


def main():
    a = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(1)

    tok = AutoTokenizer.from_pretrained(a.model)
    raw = load_dataset("squad_v2")
    if rank != 0:
        dist.barrier()
    train = raw["train"].map(train_features, batched=True, fn_kwargs={"tok": tok, "a": a},
                             remove_columns=raw["train"].column_names, num_proc=8)
    dev_feats = raw["validation"].map(eval_features, batched=True, fn_kwargs={"tok": tok, "a": a},
                                      remove_columns=raw["validation"].column_names, num_proc=8)
    if rank == 0:
        dist.barrier()
    dev = dev_feats.remove_columns(["example_id", "offset_mapping"]).add_column("fidx", list(range(len(dev_feats))))

    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    sampler = DistributedSampler(train, shuffle=True, seed=1, drop_last=True)
    train_dl = DataLoader(train, batch_size=a.bs, sampler=sampler, collate_fn=collator, num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev, batch_size=64, sampler=DistributedSampler(dev, shuffle=False), collate_fn=collator)

    model = AutoModelForQuestionAnswering.from_pretrained(a.model)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={RobertaLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
        use_orig_params=True,
    )
    # optimizer is built on the sharded (flattened) parameters, after wrapping
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    total = a.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(a.warmup * total), total)
    metric = evaluate.load("squad_v2")
    logger.info("FSDP over %d ranks, %d steps", world, total)

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
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        logits = predict(model, dev_dl, device)
        if rank == 0:
            preds = postprocess(raw["validation"], dev_feats, logits, a)
            refs = [{"id": ex["id"], "answers": ex["answers"]} for ex in raw["validation"]]
            res = metric.compute(predictions=preds, references=refs)
            logger.info("epoch %d: EM %.2f F1 %.2f", epoch, res["exact"], res["f1"])
            os.makedirs(a.output_dir, exist_ok=True)
            with open(os.path.join(a.output_dir, f"dev_epoch{epoch}.json"), "w") as f:
                json.dump(res, f, indent=2)
        save_full(model, opt, tok, os.path.join(a.output_dir, f"epoch{epoch}"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
