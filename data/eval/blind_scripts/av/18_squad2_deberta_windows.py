"""SQuAD 2.0 with DeBERTa-v3-base: sliding windows over long contexts, null-answer threshold,
EM / F1 over the whole dev set. Plain DDP, bf16.

torchrun --nproc_per_node=8 18_squad2_deberta_windows.py --output_dir runs/squad2_debv3
"""
import argparse
import collections
import json
import os
import time

import evaluate
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, default_data_collator, get_scheduler

cfg = argparse.ArgumentParser()
cfg.add_argument("--model", default="microsoft/deberta-v3-base")
cfg.add_argument("--output_dir", required=True)
cfg.add_argument("--max_len", type=int, default=512)
cfg.add_argument("--stride", type=int, default=128)
cfg.add_argument("--bs", type=int, default=8)
cfg.add_argument("--lr", type=float, default=3e-5)
cfg.add_argument("--epochs", type=int, default=3)
cfg.add_argument("--warmup_ratio", type=float, default=0.1)
cfg.add_argument("--layer_decay", type=float, default=0.9)
cfg.add_argument("--n_best", type=int, default=20)
cfg.add_argument("--max_answer_len", type=int, default=30)
cfg.add_argument("--seed", type=int, default=11)


def train_features(tok, args):
    def fn(ex):
        enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second",
                  max_length=args.max_len, stride=args.stride, return_overflowing_tokens=True,
                  return_offsets_mapping=True, padding="max_length")
        smap = enc.pop("overflow_to_sample_mapping")
        offs = enc.pop("offset_mapping")
        sp, ep = [], []
        for i, off in enumerate(offs):
            ans = ex["answers"][smap[i]]
            seq = enc.sequence_ids(i)
            if len(ans["answer_start"]) == 0:
                sp.append(0)
                ep.append(0)
                continue
            s_char = ans["answer_start"][0]
            e_char = s_char + len(ans["text"][0])
            c0 = seq.index(1)
            c1 = len(seq) - 1 - seq[::-1].index(1)
            if off[c0][0] > s_char or off[c1][1] < e_char:
                sp.append(0)
                ep.append(0)
                continue
            s = c0
            while s <= c1 and off[s][0] <= s_char:
                s += 1
            e = c1
            while e >= c0 and off[e][1] >= e_char:
                e -= 1
            sp.append(s - 1)
            ep.append(e + 1)
        enc["start_positions"], enc["end_positions"] = sp, ep
        return enc
    return fn


def eval_features(tok, args):
    def fn(ex):
        enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second",
                  max_length=args.max_len, stride=args.stride, return_overflowing_tokens=True,
                  return_offsets_mapping=True, padding="max_length")
        smap = enc.pop("overflow_to_sample_mapping")
        enc["example_id"] = [ex["id"][j] for j in smap]
        enc["offset_mapping"] = [[o if enc.sequence_ids(i)[k] == 1 else None for k, o in enumerate(off)]
                                 for i, off in enumerate(enc["offset_mapping"])]
        return enc
    return fn


def layerwise_groups(model, lr, decay):
    n_layers = model.config.num_hidden_layers
    groups = []
    for name, p in model.named_parameters():
        if "encoder.layer." in name:
            depth = int(name.split("encoder.layer.")[1].split(".")[0]) + 1
        elif "embeddings" in name:
            depth = 0
        else:
            depth = n_layers + 1
        scale = decay ** (n_layers + 1 - depth)
        wd = 0.0 if p.ndim == 1 else 0.01
        groups.append({"params": [p], "lr": lr * scale, "weight_decay": wd})
    return groups


def postprocess(examples, feats, logits, args):
    per_ex = collections.defaultdict(list)
    for i, eid in enumerate(feats["example_id"]):
        per_ex[eid].append(i)
    preds = []
    for ex in examples:
        null_score, best, best_text = float("inf"), -float("inf"), ""
        for fi in per_ex[ex["id"]]:
            s_log, e_log = logits[fi]
            off = feats[fi]["offset_mapping"]
            null_score = min(null_score, s_log[0] + e_log[0])
            for s in np.argsort(s_log)[-args.n_best:]:
                for e in np.argsort(e_log)[-args.n_best:]:
                    if off[s] is None or off[e] is None or e < s or e - s + 1 > args.max_answer_len:
                        continue
                    if s_log[s] + e_log[e] > best:
                        best, best_text = s_log[s] + e_log[e], ex["context"][off[s][0]:off[e][1]]
        text = best_text if best > null_score else ""
        preds.append({"id": ex["id"], "prediction_text": text, "no_answer_probability": 0.0})
    return preds


@torch.no_grad()
def run_eval(model, feats, loader, examples, args, device, world):
    model.eval()
    local = {}
    for batch in loader:
        fidx = batch.pop("feature_idx").tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        for j, fi in enumerate(fidx):
            local[fi] = (out.start_logits[j].float().cpu().numpy(), out.end_logits[j].float().cpu().numpy())
    shards = [None] * world
    dist.all_gather_object(shards, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    logits = {}
    for s in shards:
        logits.update(s)  # padded duplicates from the sampler collapse here
    preds = postprocess(examples, feats, logits, args)
    refs = [{"id": ex["id"], "answers": ex["answers"]} for ex in examples]
    return evaluate.load("squad_v2").compute(predictions=preds, references=refs)


def main():
    args = cfg.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    raw = load_dataset("squad_v2")
    if rank > 0:
        dist.barrier()
    tr = raw["train"].map(train_features(tok, args), batched=True, remove_columns=raw["train"].column_names,
                          num_proc=8)
    dv = raw["validation"].map(eval_features(tok, args), batched=True,
                               remove_columns=raw["validation"].column_names, num_proc=8)
    dv = dv.map(lambda _, i: {"feature_idx": i}, with_indices=True)  # global id, survives sharding
    if rank == 0:
        dist.barrier()

    sampler = DistributedSampler(tr, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(tr.with_format("torch"), batch_size=args.bs, sampler=sampler,
                              collate_fn=default_data_collator, num_workers=4, pin_memory=True)
    dv_inputs = dv.remove_columns(["example_id", "offset_mapping"]).with_format("torch")
    dev_loader = DataLoader(dv_inputs, batch_size=64, sampler=DistributedSampler(dv_inputs, shuffle=False),
                            collate_fn=default_data_collator, num_workers=2)

    model = AutoModelForQuestionAnswering.from_pretrained(args.model).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(layerwise_groups(model, args.lr, args.layer_decay), eps=1e-6)
    steps = len(train_loader) * args.epochs
    sched = get_scheduler("linear", opt, num_warmup_steps=int(args.warmup_ratio * steps), num_training_steps=steps)

    best = -1.0
    for epoch in range(args.epochs):
        ddp.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        res = run_eval(model, dv, dev_loader, raw["validation"], args, device, world)
        if rank == 0:
            print(f"epoch {epoch}: loss {(run[0] / run[1]).item():.4f} EM {res['exact']:.2f} F1 {res['f1']:.2f} "
                  f"HasAns F1 {res['HasAns_f1']:.2f} NoAns F1 {res['NoAns_f1']:.2f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if res["f1"] > best:
                best = res["f1"]
                model.save_pretrained(args.output_dir)
                tok.save_pretrained(args.output_dir)
                with open(os.path.join(args.output_dir, "dev_results.json"), "w") as f:
                    json.dump({"epoch": epoch, **res}, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
