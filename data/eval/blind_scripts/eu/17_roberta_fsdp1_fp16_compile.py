"""RoBERTa-large / XLM-R-large sequence-pair classification with FSDP1 on the V100 partition.

fp16 compute with ShardedGradScaler, torch.compile on the FSDP module
(use_orig_params=True), sharded DCP checkpoints, exact distributed eval.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        17_roberta_fsdp1_fp16_compile.py --train /gpfs/nli/train.jsonl --dev /gpfs/nli/dev.jsonl
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaLayer

LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="FacebookAI/xlm-roberta-large")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", default="/gpfs/ckpt/xlmr-large-nli")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=float, default=0.06)
    ap.add_argument("--compile", action="store_true")
    return ap.parse_args()


class NLI(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [r for r in map(json.loads, f) if r["label"] in LABELS]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return r["premise"], r["hypothesis"], LABELS[r["label"]], i


class IndexDataset(Dataset):
    """Yields the sampler's indices unchanged (including the -1 padding marker)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class PaddedEvalSampler(Sampler):
    """Strided shard of the eval set, padded to the same length on every rank.

    Every rank has to run the same number of forward passes under FSDP, so the
    shards are padded; the padded slots are flagged and dropped from the metrics.
    """

    def __init__(self, n, rank, world):
        self.n, self.rank, self.world = n, rank, world
        self.per_rank = math.ceil(n / world)

    def __len__(self):
        return self.per_rank

    def __iter__(self):
        for j in range(self.per_rank):
            idx = self.rank + j * self.world
            yield idx if idx < self.n else -1


def make_collate(tok, max_len, ds):
    def collate(items):
        rows = [ds[i] if i >= 0 else ds[0] for i in items]
        valid = torch.tensor([i >= 0 for i in items])
        prem, hyp, lab, _ = zip(*rows)
        enc = tok(list(prem), list(hyp), truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor(lab), valid
    return collate


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=len(LABELS))
    fsdp_model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={XLMRobertaLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        device_id=dev,
        sync_module_states=True,
        use_orig_params=True,
    )
    model = torch.compile(fsdp_model, dynamic=True) if args.compile else fsdp_model
    scaler = ShardedGradScaler(init_scale=2.0 ** 14)

    train_ds, dev_ds = NLI(args.train), NLI(args.dev)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    # the loaders iterate over indices; collate looks the rows up (and handles the -1 eval padding)
    train_loader = DataLoader(
        IndexDataset(len(train_ds)), batch_size=args.bs, sampler=train_sampler, num_workers=4, drop_last=True,
        collate_fn=make_collate(tok, args.max_len, train_ds),
    )
    dev_loader = DataLoader(
        IndexDataset(len(dev_ds)), batch_size=64, sampler=PaddedEvalSampler(len(dev_ds), rank, world),
        num_workers=2, collate_fn=make_collate(tok, args.max_len, dev_ds),
    )

    optim = torch.optim.AdamW(fsdp_model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    warm = int(args.warmup * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / (total - warm)))

    def evaluate():
        model.eval()
        c = torch.zeros(3, device=dev)
        with torch.no_grad():
            for ids, mask, lab, valid in dev_loader:
                ids, mask, lab, valid = ids.to(dev), mask.to(dev), lab.to(dev), valid.to(dev)
                logits = model(input_ids=ids, attention_mask=mask).logits.float()
                c[0] += (F.cross_entropy(logits, lab, reduction="none") * valid).sum()
                c[1] += ((logits.argmax(-1) == lab) & valid).sum()
                c[2] += valid.sum()
        dist.all_reduce(c)
        model.train()
        return (c[0] / c[2]).item(), (c[1] / c[2]).item()

    start_epoch = 0
    ckpt_meta = os.path.join(args.out, "last_epoch.json")
    if os.path.exists(ckpt_meta):
        with open(ckpt_meta) as f:
            start_epoch = json.load(f)["epoch"] + 1
        msd, osd = get_state_dict(fsdp_model, optim)
        st = {"model": msd, "optim": osd}
        dcp.load(st, checkpoint_id=os.path.join(args.out, f"epoch_{start_epoch - 1}"))
        set_state_dict(fsdp_model, optim, model_state_dict=st["model"], optim_state_dict=st["optim"])
        sched.last_epoch = start_epoch * len(train_loader)

    best_acc = 0.0
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (ids, mask, lab, _) in enumerate(train_loader):
            ids, mask, lab = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True), lab.to(dev)
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = F.cross_entropy(logits.float(), lab)
            scaler.scale(loss).backward()
            scaler.unscale_(optim)
            fsdp_model.clip_grad_norm_(1.0)
            scaler.step(optim)
            scaler.update()
            sched.step()
            optim.zero_grad(set_to_none=True)
            if i % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {i}/{len(train_loader)} loss {l.item():.4f} scale {scaler.get_scale():.0f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()

        dev_loss, dev_acc = evaluate()
        if rank == 0:
            print(f"epoch {epoch} dev_loss {dev_loss:.4f} dev_acc {dev_acc:.4f}", flush=True)
        msd, osd = get_state_dict(fsdp_model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.out, f"epoch_{epoch}"))
        if dev_acc > best_acc:
            best_acc = dev_acc
            dcp.save({"model": msd}, checkpoint_id=os.path.join(args.out, "best"))
        if rank == 0:
            with open(ckpt_meta, "w") as f:
                json.dump({"epoch": epoch, "dev_acc": dev_acc, "best_acc": best_acc}, f)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
