"""
SQuAD 2.0: RoBERTa-large span extractor + answerability verifier head.
Custom DDP loop, fp16 with GradScaler.

torchrun --nproc_per_node=8 04_qa_squad2_roberta_verifier.py \
    --output_dir /checkpoints/squad2-rl-verifier --max_seq_length 512
"""
import argparse
import collections
import json
import logging
import math
import os

import evaluate
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

logger = logging.getLogger("squad2")


class QAWithVerifier(nn.Module):
    def __init__(self, name, dropout=0.1):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name)
        hidden = self.backbone.config.hidden_size
        self.qa_outputs = nn.Linear(hidden, 2)
        self.verifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        )

    def forward(self, input_ids, attention_mask, start_positions=None, end_positions=None, is_impossible=None):
        seq = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        start_logits, end_logits = self.qa_outputs(seq).float().unbind(dim=-1)
        start_logits = start_logits.masked_fill(attention_mask == 0, -1e4)
        end_logits = end_logits.masked_fill(attention_mask == 0, -1e4)
        na_logits = self.verifier(seq[:, 0]).float().squeeze(-1)
        if start_positions is None:
            return start_logits, end_logits, na_logits
        span_loss = (F.cross_entropy(start_logits, start_positions) + F.cross_entropy(end_logits, end_positions)) / 2
        na_loss = F.binary_cross_entropy_with_logits(na_logits, is_impossible.float())
        return span_loss + 0.5 * na_loss


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="roberta-large")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_seq_length", type=int, default=384)
    ap.add_argument("--doc_stride", type=int, default=128)
    ap.add_argument("--train_batch_size", type=int, default=8, help="per GPU")
    ap.add_argument("--eval_batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_proportion", type=float, default=0.1)
    ap.add_argument("--na_threshold", type=float, default=0.5)
    ap.add_argument("--n_best", type=int, default=20)
    ap.add_argument("--max_answer_len", type=int, default=30)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def train_features(examples, tok, args):
    q = [x.lstrip() for x in examples["question"]]
    enc = tok(q, examples["context"], truncation="only_second", max_length=args.max_seq_length,
              stride=args.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    starts, ends, impossible = [], [], []
    for i, offsets in enumerate(enc.pop("offset_mapping")):
        seq_ids = enc.sequence_ids(i)
        ans = examples["answers"][smap[i]]
        ctx_start = seq_ids.index(1)
        ctx_end = len(seq_ids) - 1 - seq_ids[::-1].index(1)
        if len(ans["answer_start"]) == 0:
            starts.append(0); ends.append(0); impossible.append(1)
            continue
        s_char = ans["answer_start"][0]
        e_char = s_char + len(ans["text"][0])
        if offsets[ctx_start][0] > s_char or offsets[ctx_end][1] < e_char:
            starts.append(0); ends.append(0); impossible.append(1)
            continue
        s = ctx_start
        while s <= ctx_end and offsets[s][0] <= s_char:
            s += 1
        e = ctx_end
        while e >= ctx_start and offsets[e][1] >= e_char:
            e -= 1
        starts.append(s - 1); ends.append(e + 1); impossible.append(0)
    enc["start_positions"], enc["end_positions"], enc["is_impossible"] = starts, ends, impossible
    return enc


def eval_features(examples, tok, args):
    q = [x.lstrip() for x in examples["question"]]
    enc = tok(q, examples["context"], truncation="only_second", max_length=args.max_seq_length,
              stride=args.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = [examples["id"][j] for j in smap]
    for i in range(len(enc["input_ids"])):
        seq_ids = enc.sequence_ids(i)
        enc["offset_mapping"][i] = [o if seq_ids[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][i])]
    return enc


def postprocess(examples, features, outputs, args):
    feats = collections.defaultdict(list)
    for i, ex_id in enumerate(features["example_id"]):
        feats[ex_id].append(i)
    preds = []
    for ex in examples:
        best_text, best_score, na_prob = "", -math.inf, 1.0
        for fi in feats[ex["id"]]:
            start, end, na = outputs[fi]
            na_prob = min(na_prob, 1 / (1 + math.exp(-na)))
            offsets = features[fi]["offset_mapping"]
            for s in np.argsort(start)[::-1][: args.n_best]:
                for e in np.argsort(end)[::-1][: args.n_best]:
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > args.max_answer_len:
                        continue
                    score = start[s] + end[e]
                    if score > best_score:
                        best_score = score
                        best_text = ex["context"][offsets[s][0]: offsets[e][1]]
        text = "" if na_prob > args.na_threshold else best_text
        preds.append({"id": ex["id"], "prediction_text": text, "no_answer_probability": na_prob})
    return preds


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    local = []
    for batch in loader:
        fidx = batch.pop("feature_idx").tolist()
        lengths = batch["attention_mask"].sum(1).tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            s, e, na = model(**batch)
        for j, i in enumerate(fidx):
            n = lengths[j]
            local.append((i, s[j, :n].cpu().numpy(), e[j, :n].cpu().numpy(), na[j].item()))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    model.train()
    return {i: (s, e, na) for part in parts for i, s, e, na in part}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name)
    raw = load_dataset("squad_v2")
    if rank != 0:
        dist.barrier()
    train_ds = raw["train"].map(train_features, batched=True, fn_kwargs={"tok": tok, "args": args},
                                remove_columns=raw["train"].column_names, num_proc=16)
    dev_feats = raw["validation"].map(eval_features, batched=True, fn_kwargs={"tok": tok, "args": args},
                                      remove_columns=raw["validation"].column_names, num_proc=16)
    if rank == 0:
        dist.barrier()
    dev_ds = dev_feats.remove_columns(["example_id", "offset_mapping"])
    dev_ds = dev_ds.add_column("feature_idx", list(range(len(dev_ds))))

    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.train_batch_size, sampler=train_sampler,
                          collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=args.eval_batch_size, sampler=DistributedSampler(dev_ds, shuffle=False),
                        collate_fn=collator, num_workers=4)

    model = QAWithVerifier(args.model_name)
    # roberta-large at 512 tokens does not fit in memory with batch 8 otherwise
    model.backbone.gradient_checkpointing_enable()
    model.to(device)
    # the backbone's pooler is not part of the graph
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    no_decay = ["bias", "LayerNorm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(x in n for x in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(x in n for x in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(total * args.warmup_proportion), total)
    scaler = torch.cuda.amp.GradScaler()
    squad_v2 = evaluate.load("squad_v2")

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 200 == 0:
                logger.info("epoch %d step %d/%d loss %.4f scale %.0f", epoch, step, total, loss.item(), scaler.get_scale())

        outputs = predict(model, dev_dl, device)
        if rank == 0:
            preds = postprocess(raw["validation"], dev_feats, outputs, args)
            refs = [{"id": ex["id"], "answers": ex["answers"]} for ex in raw["validation"]]
            res = squad_v2.compute(predictions=preds, references=refs)
            logger.info("epoch %d: EM %.2f F1 %.2f HasAns_F1 %.2f NoAns_F1 %.2f", epoch,
                        res["exact"], res["f1"], res.get("HasAns_f1", 0.0), res.get("NoAns_f1", 0.0))
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.output_dir, f"model_epoch{epoch}.pt"))
            with open(os.path.join(args.output_dir, f"dev_epoch{epoch}.json"), "w") as f:
                json.dump(res, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
