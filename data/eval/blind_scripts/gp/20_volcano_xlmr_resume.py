"""XLM-R large intent classifier, Volcano Job on Kubernetes, preemptible nodes.

volcano/xlmr-job.yaml declares one task "worker" with replicas: 4, plugins
{svc: [], env: []}, so each pod gets VC_TASK_INDEX and VC_WORKER_HOSTS
(comma-separated stable hostnames). Every pod has 8 x A100-40GB and the
shared CephFS volume at /ckpt. Pods get evicted now and then; the job restarts
all pods and training continues from /ckpt/<run>/latest.pt.

Container command:
    python /app/xlmr_intent.py --run xlmr-intent-v4 --train /data/intent/train.parquet --dev /data/intent/dev.parquet
"""
import argparse
import os
import sys
import time

import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def exec_torchrun():
    hosts = os.environ["VC_WORKER_HOSTS"].split(",")
    node_rank = int(os.environ["VC_TASK_INDEX"])
    port = os.environ.get("MASTER_PORT", "23456")
    argv = [sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={len(hosts)}", f"--node_rank={node_rank}", "--nproc_per_node=8",
            f"--master_addr={hosts[0]}", f"--master_port={port}",
            os.path.abspath(__file__), *sys.argv[1:]]
    os.execv(sys.executable, argv)


class IntentData(Dataset):
    def __init__(self, path, label2id):
        df = pd.read_parquet(path)
        self.text = df["utterance"].tolist()
        self.y = [label2id[l] for l in df["intent"]]

    def __len__(self):
        return len(self.text)

    def __getitem__(self, i):
        return self.text[i], self.y[i]


def make_collate(tok, max_len):
    def collate(batch):
        texts, ys = zip(*batch)
        enc = tok(list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(ys)
        return enc
    return collate


def save(path, model, opt, sched, epoch, step, best):
    tmp = f"{path}.tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "epoch": epoch, "step": step, "best": best}, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--model", default="xlm-roberta-large")
    ap.add_argument("--ckpt-root", default="/ckpt")
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--save-every", type=int, default=500)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    labels = sorted(pd.read_parquet(args.train, columns=["intent"])["intent"].unique())
    label2id = {l: i for i, l in enumerate(labels)}
    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds, dev_ds = IntentData(args.train, label2id), IntentData(args.dev, label2id)
    per_gpu = args.global_batch // world
    sampler = DistributedSampler(train_ds, shuffle=True, seed=7, drop_last=True)
    dl = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, collate_fn=make_collate(tok, args.max_len),
                    num_workers=4, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=256,
                        collate_fn=make_collate(tok, args.max_len), num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=len(labels)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(dl)
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    run_dir = os.path.join(args.ckpt_root, args.run)
    latest = os.path.join(run_dir, "latest.pt")
    start_epoch, step, skip, best = 0, 0, 0, 0.0
    if os.path.exists(latest):
        ck = torch.load(latest)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, step, best = ck["epoch"], ck["step"], ck["best"]
        skip = step - start_epoch * len(dl)
        del ck
        if rank == 0:
            print(f"resuming at epoch {start_epoch} step {step}", flush=True)
    elif rank == 0:
        os.makedirs(run_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(dl):
            if i < skip:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % args.save_every == 0:
                if rank == 0:
                    save(latest, model, opt, sched, epoch, step, best)
                    print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{time.time() - t0:.0f}s", flush=True)
                dist.barrier()
        skip = 0

        model.eval()
        hit = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in dev_dl:
                batch = {k: v.to(device) for k, v in batch.items()}
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(**batch).logits.argmax(-1)
                hit[0] += (pred == batch["labels"]).sum()
                hit[1] += pred.numel()
        dist.all_reduce(hit)
        acc = (hit[0] / hit[1]).item()
        if rank == 0:
            print(f"epoch {epoch} dev_acc {acc:.4f}", flush=True)
            if acc > best:
                best = acc
                model.module.save_pretrained(os.path.join(run_dir, "best"))
                tok.save_pretrained(os.path.join(run_dir, "best"))
            save(latest, model, opt, sched, epoch + 1, step, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        exec_torchrun()
    else:
        main()
