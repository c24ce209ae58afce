"""Extractive QA (SQuAD v1.1) fine-tuning, RoBERTa-base, one process per GPU via mp.spawn.

    python 03_squad_roberta_spawn.py --train_file data/squad/train-v1.1.json \
        --dev_file data/squad/dev-v1.1.json --output_dir out/squad_rb
"""
import argparse
import collections
import contextlib
import json
import os
import re
import string

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--dev_file", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--init_checkpoint", default=None, help="optional .pt with a state dict to start from")
    ap.add_argument("--max_seq_length", type=int, default=384)
    ap.add_argument("--doc_stride", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_ratio", type=float, default=0.06)
    ap.add_argument("--n_best", type=int, default=20)
    ap.add_argument("--max_answer_len", type=int, default=30)
    ap.add_argument("--port", default="29533")
    return ap.parse_args()


def read_squad(path):
    with open(path) as f:
        data = json.load(f)["data"]
    examples = []
    for article in data:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                examples.append({
                    "id": qa["id"], "question": qa["question"].strip(), "context": para["context"],
                    "answers": [a["text"] for a in qa["answers"]],
                    "answer_start": qa["answers"][0]["answer_start"] if qa["answers"] else -1,
                })
    return examples


def featurize(examples, tokenizer, args, train):
    enc = tokenizer(
        [e["question"] for e in examples], [e["context"] for e in examples],
        truncation="only_second", max_length=args.max_seq_length, stride=args.doc_stride,
        return_overflowing_tokens=True, return_offsets_mapping=True, padding="max_length",
    )
    sample_map = enc.pop("overflow_to_sample_mapping")
    starts, ends, feat_meta = [], [], []
    for i, offsets in enumerate(enc["offset_mapping"]):
        seq_ids = enc.sequence_ids(i)
        ex = examples[sample_map[i]]
        ctx_start = seq_ids.index(1)
        ctx_end = len(seq_ids) - 1 - seq_ids[::-1].index(1)
        if train:
            s_char = ex["answer_start"]
            e_char = s_char + len(ex["answers"][0])
            if offsets[ctx_start][0] > s_char or offsets[ctx_end][1] < e_char:
                starts.append(0)
                ends.append(0)
            else:
                s = ctx_start
                while s <= ctx_end and offsets[s][0] <= s_char:
                    s += 1
                e = ctx_end
                while e >= ctx_start and offsets[e][1] >= e_char:
                    e -= 1
                starts.append(s - 1)
                ends.append(e + 1)
        # keep only context offsets for post-processing
        feat_meta.append((sample_map[i], [o if seq_ids[k] == 1 else None for k, o in enumerate(offsets)]))
    tensors = [torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"])]
    if train:
        tensors += [torch.tensor(starts), torch.tensor(ends)]
    else:
        tensors += [torch.arange(len(feat_meta))]
    return TensorDataset(*tensors), feat_meta


def normalize_answer(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(pred, gold):
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    common = collections.Counter(p) & collections.Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(g)
    return 2 * prec * rec / (prec + rec)


def squad_metrics(predictions, examples):
    em = f1 = 0.0
    for ex in examples:
        pred = predictions.get(ex["id"], "")
        em += max(float(normalize_answer(pred) == normalize_answer(a)) for a in ex["answers"])
        f1 += max(f1_score(pred, a) for a in ex["answers"])
    return {"exact_match": 100 * em / len(examples), "f1": 100 * f1 / len(examples)}


def postprocess(examples, feat_meta, all_logits, args):
    by_example = collections.defaultdict(list)
    for feat_idx, (ex_idx, _) in enumerate(feat_meta):
        if feat_idx in all_logits:
            by_example[ex_idx].append(feat_idx)
    preds = {}
    for ex_idx, ex in enumerate(examples):
        best_text, best_score = "", -1e9
        for fi in by_example[ex_idx]:
            start_logits, end_logits = all_logits[fi]
            offsets = feat_meta[fi][1]
            s_idx = np.argsort(start_logits)[-1:-args.n_best - 1:-1]
            e_idx = np.argsort(end_logits)[-1:-args.n_best - 1:-1]
            for s in s_idx:
                for e in e_idx:
                    if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > args.max_answer_len:
                        continue
                    score = start_logits[s] + end_logits[e]
                    if score > best_score:
                        best_score = score
                        best_text = ex["context"][offsets[s][0]:offsets[e][1]]
        preds[ex["id"]] = best_text
    return preds


@torch.no_grad()
def evaluate(model, loader, examples, feat_meta, args, device, world_size):
    model.eval()
    local = {}
    for input_ids, attn, feat_idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=input_ids.to(device), attention_mask=attn.to(device))
        s = out.start_logits.float().cpu().numpy()
        e = out.end_logits.float().cpu().numpy()
        for k, fi in enumerate(feat_idx.tolist()):
            local[fi] = (s[k], e[k])
    # DistributedSampler pads the last shard with repeats; keying by feature index drops them
    parts = [None] * world_size
    dist.all_gather_object(parts, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    merged = {}
    for p in parts:
        merged.update(p)
    assert len(merged) == len(feat_meta)
    preds = postprocess(examples, feat_meta, merged, args)
    return squad_metrics(preds, examples), preds


def main_worker(local_rank, world_size, args):
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=local_rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    is_main = local_rank == 0
    torch.manual_seed(1234)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_examples = read_squad(args.train_file)
    dev_examples = read_squad(args.dev_file)
    train_ds, _ = featurize(train_examples, tokenizer, args, train=True)
    dev_ds, dev_meta = featurize(dev_examples, tokenizer, args, train=False)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=local_rank, shuffle=True)
    dev_sampler = DistributedSampler(dev_ds, num_replicas=world_size, rank=local_rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)
    dev_loader = DataLoader(dev_ds, batch_size=64, sampler=dev_sampler, num_workers=2)

    model = AutoModelForQuestionAnswering.from_pretrained(args.model)
    if args.init_checkpoint:
        sd = torch.load(args.init_checkpoint, map_location="cpu")
        sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if is_main:
            print(f"init from {args.init_checkpoint}: missing={missing} unexpected={unexpected}")
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) // args.grad_accum * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best_f1 = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for it, (input_ids, attn, start_pos, end_pos) in enumerate(train_loader):
            input_ids, attn = input_ids.to(device, non_blocking=True), attn.to(device, non_blocking=True)
            start_pos, end_pos = start_pos.to(device), end_pos.to(device)
            sync_now = (it + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not sync_now else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=input_ids, attention_mask=attn,
                                 start_positions=start_pos, end_positions=end_pos).loss
                (loss / args.grad_accum).backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step % 100 == 0:
                    l = loss.detach().clone()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if is_main:
                        print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                              flush=True)

        result = evaluate(model.module, dev_loader, dev_examples, dev_meta, args, device, world_size)
        if is_main:
            metrics, preds = result
            print(f"epoch {epoch}: EM {metrics['exact_match']:.2f} F1 {metrics['f1']:.2f}", flush=True)
            os.makedirs(args.output_dir, exist_ok=True)
            if metrics["f1"] > best_f1:
                best_f1 = metrics["f1"]
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
                with open(os.path.join(args.output_dir, "predictions.json"), "w") as f:
                    json.dump(preds, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    n_gpus = torch.cuda.device_count()
    mp.spawn(main_worker, args=(n_gpus, args), nprocs=n_gpus, join=True)
