"""Joint sequence tagging on three corpora with task-specific CRF-free softmax heads:

    ner   : CoNLL-2003 English (14k sentences)
    pos   : UD English-EWT UPOS (12.5k sentences)
    chunk : CoNLL-2000 (8.9k sentences)

A step samples one corpus proportional to its size (same sample on all ranks).

    torchrun --nproc_per_node=4 18_joint_tagging_ner_pos_chunk.py --out runs/joint_tagging
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from seqeval.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorForTokenClassification

CORPORA = {
    "ner": ("conll2003", "ner_tags"),
    "pos": ("universal_dependencies", "upos"),
    "chunk": ("conll2000", "chunk_tags"),
}
CONFIGS = {"universal_dependencies": "en_ewt"}


def align(tok, max_len, tag_col):
    def fn(batch):
        enc = tok(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
        labels = []
        for i, tags in enumerate(batch[tag_col]):
            prev, lab = None, []
            for w in enc.word_ids(i):
                lab.append(-100 if w is None or w == prev else tags[w])
                prev = w
            labels.append(lab)
        enc["labels"] = labels
        return enc
    return fn


class Tagger(nn.Module):
    def __init__(self, name, n_tags):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.encoder.config.hidden_size
        self.drop = nn.Dropout(0.1)
        self.heads = nn.ModuleDict({t: nn.Linear(h, n) for t, n in n_tags.items()})

    def forward(self, task, input_ids, attention_mask):
        hs = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.heads[task](self.drop(hs))


@torch.no_grad()
def evaluate(net, dev, collate, names, device, rank, world):
    net.eval()
    scores = {}
    for task, ds in dev.items():
        preds, golds = [], []
        for b in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=64, collate_fn=collate):
            b = {k: v.to(device) for k, v in b.items()}
            logits = net(task, b["input_ids"], b["attention_mask"])
            m = b["labels"] != -100
            preds.append(logits.argmax(-1)[m])
            golds.append(b["labels"][m])
        preds, golds = torch.cat(preds), torch.cat(golds)
        all_p = [torch.zeros_like(preds) for _ in range(world)]
        all_g = [torch.zeros_like(golds) for _ in range(world)]
        dist.all_gather(all_p, preds)
        dist.all_gather(all_g, golds)
        p, g = torch.cat(all_p).cpu(), torch.cat(all_g).cpu()
        if task == "ner":
            scores[task] = f1_score([[names[task][i] for i in g.tolist()]], [[names[task][i] for i in p.tolist()]])
        else:
            scores[task] = (p == g).float().mean().item()
    net.train()
    return scores


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-large-cased")
    ap.add_argument("--out", default="runs/joint_tagging")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--max_len", type=int, default=192)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    collate = DataCollatorForTokenClassification(tok, pad_to_multiple_of=8)
    train, dev, names = {}, {}, {}
    # rank 0 downloads and tokenizes first; the other ranks then hit the datasets cache
    if rank != 0:
        dist.barrier()
    for task, (hub, col) in CORPORA.items():
        raw = load_dataset(hub, CONFIGS.get(hub))
        names[task] = raw["train"].features[col].feature.names
        fn = align(tok, args.max_len, col)
        train[task] = raw["train"].map(fn, batched=True, remove_columns=raw["train"].column_names)
        dev[task] = raw["validation"].map(fn, batched=True, remove_columns=raw["validation"].column_names)
    if rank == 0:
        dist.barrier()

    loaders, samplers, its, passes = {}, {}, {}, {}
    for task, ds in train.items():
        samplers[task] = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loaders[task] = DataLoader(ds, batch_size=args.bs, sampler=samplers[task], collate_fn=collate,
                                   num_workers=2, pin_memory=True, drop_last=True)
        passes[task] = 0
        samplers[task].set_epoch(0)
        its[task] = iter(loaders[task])

    tasks = list(train)
    sizes = [len(train[t]) for t in tasks]
    pick = random.Random(args.seed)

    model = Tagger(args.model, {t: len(n) for t, n in names.items()}).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 1000, max(0.0, (args.steps - s) / (args.steps - 1000))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best, t0 = -1.0, time.time()
    for step in range(args.steps):
        task = pick.choices(tasks, weights=sizes)[0]
        try:
            b = next(its[task])
        except StopIteration:
            passes[task] += 1
            samplers[task].set_epoch(passes[task])
            its[task] = iter(loaders[task])
            b = next(its[task])
        b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
        logits = model(task, b["input_ids"], b["attention_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if rank == 0 and step % 100 == 0:
            print(f"step {step} [{task}] loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)

        if (step + 1) % args.eval_every == 0:
            scores = evaluate(model.module, dev, collate, names, device, rank, world)
            avg = sum(scores.values()) / len(scores)
            if rank == 0:
                print(f"eval @{step + 1}: {scores} avg {avg:.4f}", flush=True)
                if avg > best:
                    best = avg
                    torch.save({"model": model.module.state_dict(), "names": names, "step": step + 1},
                               os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
