"""Active learning for NER (CoNLL-2003) with MNLP
(Maximum Normalized Log-Probability, Shen et al. 2018).

Sentences are queried by the length-normalised log-probability of the greedy tag
sequence; the lowest ones are sent to the annotator (simulated with gold tags).

    torchrun --standalone --nproc_per_node=4 18_ner_mnlp_conll.py --output_dir runs/ner_mnlp
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from seqeval.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import AutoModelForTokenClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="bert-base-cased")
    ap.add_argument("--output_dir", default="runs/ner_mnlp")
    ap.add_argument("--init_sentences", type=int, default=500)
    ap.add_argument("--budget", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--per_device_bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max_len", type=int, default=160)
    ap.add_argument("--seed", type=int, default=13)
    return ap.parse_args()


class NERCollate:
    """Tokenise pre-split words; only the first sub-token of each word carries a label."""

    def __init__(self, tokenizer, max_len):
        self.tok, self.max_len = tokenizer, max_len

    def __call__(self, rows):
        enc = self.tok([r["tokens"] for r in rows], is_split_into_words=True, truncation=True,
                       max_length=self.max_len, padding=True, return_tensors="pt")
        labels = torch.full(enc["input_ids"].shape, -100, dtype=torch.long)
        for b, r in enumerate(rows):
            prev = None
            for t, w in enumerate(enc.word_ids(b)):
                if w is not None and w != prev:
                    labels[b, t] = r["ner_tags"][w]
                prev = w
        enc = dict(enc)
        enc["labels"] = labels
        return enc


def save_checkpoint(model, tokenizer, labelled, rnd, metrics, out_dir):
    ckpt_dir = os.path.join(out_dir, f"round_{rnd:02d}")
    os.makedirs(ckpt_dir, exist_ok=True)
    model.module.save_pretrained(ckpt_dir)
    tokenizer.save_pretrained(ckpt_dir)
    with open(os.path.join(ckpt_dir, "al_state.json"), "w") as f:
        json.dump({"round": rnd, "labelled": labelled, "metrics": metrics}, f)


def train(model, ds, labelled, collate, args, device):
    sub = Subset(ds, labelled)
    sampler = DistributedSampler(sub, shuffle=True, seed=args.seed)
    loader = DataLoader(sub, batch_size=args.per_device_bs, sampler=sampler, collate_fn=collate, num_workers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)


@torch.no_grad()
def predict(net, ds, indices, collate, device, bs=64):
    """Per-sentence (position, predicted tags, gold tags, MNLP score) for this rank's shard."""
    sub = Subset(ds, indices)
    sampler = DistributedSampler(sub, shuffle=False)
    positions = list(sampler)
    loader = DataLoader(sub, batch_size=bs, sampler=sampler, collate_fn=collate, num_workers=2)
    net.eval()
    out, k = [], 0
    for batch in loader:
        labels = batch.pop("labels")
        batch = {key: v.to(device) for key, v in batch.items()}
        logp = F.log_softmax(net(**batch).logits.float(), dim=-1).cpu()
        best_lp, best = logp.max(-1)
        for b in range(labels.size(0)):
            m = labels[b] != -100
            n_words = int(m.sum())
            mnlp = best_lp[b][m].sum().item() / max(n_words, 1)
            out.append((positions[k], best[b][m].tolist(), labels[b][m].tolist(), mnlp))
            k += 1
    return out


def gather_predictions(local):
    world = dist.get_world_size()
    parts = [None] * world
    dist.all_gather_object(parts, local)
    merged = {}
    for part in parts:
        for pos, pred, gold, score in part:
            merged[pos] = (pred, gold, score)  # padded repeats collapse here
    return merged


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        load_dataset("conll2003")
        AutoTokenizer.from_pretrained(args.model_name)
        AutoModelForTokenClassification.from_pretrained(args.model_name, num_labels=9)
    dist.barrier()
    raw = load_dataset("conll2003")
    train_ds, test_ds = raw["train"], raw["test"]
    tag_names = raw["train"].features["ner_tags"].feature.names
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    collate = NERCollate(tokenizer, args.max_len)

    nonempty = [i for i, toks in enumerate(train_ds["tokens"]) if len(toks) > 0]
    rng = np.random.RandomState(args.seed)
    labelled = rng.choice(nonempty, args.init_sentences, replace=False).tolist()
    test_idx = [i for i, toks in enumerate(test_ds["tokens"]) if len(toks) > 0]

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        net = AutoModelForTokenClassification.from_pretrained(
            args.model_name, num_labels=len(tag_names),
            id2label=dict(enumerate(tag_names)), label2id={n: i for i, n in enumerate(tag_names)}).to(device)
        model = DDP(net, device_ids=[local_rank])
        train(model, train_ds, labelled, collate, args, device)

        res = gather_predictions(predict(net, test_ds, test_idx, collate, device))
        preds = [[tag_names[t] for t in res[p][0]] for p in sorted(res)]
        golds = [[tag_names[t] for t in res[p][1]] for p in sorted(res)]
        f1 = f1_score(golds, preds)
        if rank == 0:
            print(f"round {rnd}: {len(labelled)} sentences, test F1 {f1:.4f}, {time.time() - t0:.0f}s", flush=True)
        save_checkpoint(model, tokenizer, labelled, rnd, {"f1": f1}, args.output_dir)
        if rnd == args.rounds:
            break

        lab = set(labelled)
        pool = [i for i in nonempty if i not in lab]
        scores = gather_predictions(predict(net, train_ds, pool, collate, device, bs=128))
        ranked = sorted(scores, key=lambda p: scores[p][2])  # lowest normalised log-prob first
        labelled = labelled + [pool[p] for p in ranked[: args.budget]]

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
