#!/usr/bin/env python3
"""CoNLL-2003 NER fine-tuning. Launches itself through torch.distributed.run.

    python 13_torchrun_api_ner.py --gpus 4 --out /shared/ner/bert-base-cased

Without --worker, the script builds a torchrun command line and calls
torch.distributed.run.main() in-process (so the job wrapper does not depend on
which `torchrun` happens to be first on PATH), with --max-restarts for the
occasional flaky node.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                          get_cosine_schedule_with_warmup)


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--max-restarts", type=int, default=2)
    ap.add_argument("--model", default="bert-base-cased")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-len", type=int, default=256)
    return ap.parse_args(argv)


def launch(args):
    from torch.distributed.run import main as torchrun_main

    os.makedirs(os.path.join(args.out, "torchrun_logs"), exist_ok=True)
    passthrough = [a for a in sys.argv[1:] if a != "--worker"]
    torchrun_argv = [
        "--standalone",
        f"--nproc-per-node={args.gpus}",
        f"--max-restarts={args.max_restarts}",
        "--monitor-interval=5",
        f"--log-dir={os.path.join(args.out, 'torchrun_logs')}",
        "--redirects=3",
        "--tee=2",
        os.path.abspath(__file__),
        "--worker",
        *passthrough,
    ]
    torchrun_main(torchrun_argv)


def tokenize_and_align(tok, max_len):
    def fn(batch):
        enc = tok(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
        labels = []
        for i, tags in enumerate(batch["ner_tags"]):
            prev, lab = None, []
            for wid in enc.word_ids(i):
                lab.append(-100 if wid is None or wid == prev else tags[wid])
                prev = wid
            labels.append(lab)
        enc["labels"] = labels
        return enc
    return fn


def spans(tags, id2label):
    out, start, kind = set(), None, None
    for i, t in enumerate(list(tags) + [0]):
        name = id2label[t] if t >= 0 else "O"
        if start is not None and (name == "O" or name.startswith("B-") or name[2:] != kind):
            out.add((start, i, kind))
            start = None
        if name.startswith("B-") or (name.startswith("I-") and start is None):
            start, kind = i, name[2:]
    return out


@torch.no_grad()
def evaluate(model, dl, device, id2label):
    model.eval()
    tp = fp = fn = 0
    for batch in dl:
        batch = {k: v.to(device) for k, v in batch.items()}
        pred = model(**batch).logits.argmax(-1)
        for p, g in zip(pred.tolist(), batch["labels"].tolist()):
            keep = [i for i, x in enumerate(g) if x != -100]
            ps = spans([p[i] for i in keep], id2label)
            gs = spans([g[i] for i in keep], id2label)
            tp += len(ps & gs)
            fp += len(ps - gs)
            fn += len(gs - ps)
    stats = torch.tensor([tp, fp, fn], dtype=torch.float64)
    dist.all_reduce(stats)
    tp, fp, fn = stats.tolist()
    prec = tp / max(tp + fp, 1)
    rec = tp / max(tp + fn, 1)
    model.train()
    return 2 * prec * rec / max(prec + rec, 1e-9)


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    tok = AutoTokenizer.from_pretrained(args.model)
    # rank 0 fills the datasets cache first, the others then read it
    if rank != 0:
        dist.barrier()
    raw = load_dataset("conll2003")
    enc = raw.map(tokenize_and_align(tok, args.max_len), batched=True,
                  remove_columns=raw["train"].column_names)
    if rank == 0:
        dist.barrier()
    label_names = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_names))

    collate = DataCollatorForTokenClassification(tok)
    sampler = DistributedSampler(enc["train"], shuffle=True, seed=13)
    dl = DataLoader(enc["train"], batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                    num_workers=2, drop_last=True)
    val = enc["validation"].shard(num_shards=world, index=rank, contiguous=True)
    vdl = DataLoader(val, batch_size=64, collate_fn=collate)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(label_names), id2label=id2label,
        label2id={v: k for k, v in id2label.items()}).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(dl)
    sched = get_cosine_schedule_with_warmup(opt, int(0.1 * total), total)

    ck = os.path.join(args.out, "ckpt.pt")
    start = 0
    if os.path.exists(ck):
        st = torch.load(ck, map_location="cpu")
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start = st["epoch"] + 1
        if rank == 0:
            print(f"[restart {restart}] resuming from epoch {start}", flush=True)

    best = 0.0
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(dl)} loss {loss.item():.4f}", flush=True)
        f1 = evaluate(model.module, vdl, device, id2label)
        if rank == 0:
            print(f"epoch {epoch}: dev F1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ck + ".tmp")
            os.replace(ck + ".tmp", ck)
            if f1 > best:
                best = f1
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse()
    if a.worker:
        worker(a)
    else:
        launch(a)
