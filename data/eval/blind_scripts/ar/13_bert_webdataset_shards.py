"""
BERT-large MLM (+ no NSP) pretraining streamed from webdataset tar shards.

Each sample in a shard: <key>.ids.npy (int16/int32 token ids, length <= 512).
Shards live on the shared filesystem; every node streams independently.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        13_bert_webdataset_shards.py --shards "/mnt/shared/bert_wds/train-{000000..004095}.tar" \
        --val_shards "/mnt/shared/bert_wds/val-{000000..000063}.tar" --out /mnt/shared/ckpt/bert-large
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import BertConfig, BertForMaskedLM

PAD, CLS, SEP, MASK, VOCAB = 0, 101, 102, 103, 30522
SEQ = 512


def to_tensor(sample):
    ids = sample["ids.npy"].astype(np.int64)[:SEQ]
    out = np.full(SEQ, PAD, dtype=np.int64)
    out[: len(ids)] = ids
    return torch.from_numpy(out)


def mask_batch(ids, generator):
    labels = ids.clone()
    special = (ids == PAD) | (ids == CLS) | (ids == SEP)
    prob = torch.full(ids.shape, 0.15)
    prob[special] = 0
    m = torch.bernoulli(prob, generator=generator).bool()
    labels[~m] = -100
    r = torch.rand(ids.shape, generator=generator)
    ids = ids.clone()
    ids[m & (r < 0.8)] = MASK
    swap = m & (r >= 0.8) & (r < 0.9)
    ids[swap] = torch.randint(VOCAB, (int(swap.sum()),), generator=generator)
    return ids, (ids != PAD).long(), labels


def make_loader(urls, batch_size, steps_per_epoch, workers, train=True):
    ds = (
        wds.WebDataset(urls, resampled=train, shardshuffle=train,
                       nodesplitter=None if train else wds.split_by_node)
        .shuffle(5000 if train else 0)
        .decode()
        .map(to_tensor)
        .batched(batch_size, partial=False)
    )
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers, pin_memory=True,
                           persistent_workers=train)
    if train:
        # resampled shards are an infinite stream; give every rank the same number of batches
        loader = loader.with_epoch(steps_per_epoch)
    return loader


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--val_shards", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--total_steps", type=int, default=250000)
    p.add_argument("--steps_per_epoch", type=int, default=10000, help="optimizer steps per pseudo-epoch")
    p.add_argument("--val_batches", type=int, default=50)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--wandb", action="store_true")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device, max_batches, gen):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for i, ids in enumerate(loader):
        if i >= max_batches:
            break
        inp, att, lab = (t.to(device) for t in mask_batch(ids, gen))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=inp, attention_mask=att, labels=lab).loss
        n = (lab != -100).sum()
        s += torch.stack([loss.double() * n, n.double()])
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    a = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1000 + rank)

    run = None
    if rank == 0 and a.wandb:
        import wandb
        run = wandb.init(project="bert-large-wds", config=vars(a))

    config = BertConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, max_position_embeddings=SEQ)
    model = BertForMaskedLM(config).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / a.warmup, max(0.0, (a.total_steps - s) / (a.total_steps - a.warmup))))

    step = 0
    ckpt_path = os.path.join(a.out, "checkpoint.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
        gen.manual_seed(1000 + rank + step)
        del ck

    train_loader = make_loader(a.shards, a.batch, a.steps_per_epoch * a.accum, a.workers)
    val_loader = make_loader(a.val_shards, a.batch, None, 2, train=False)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    t0 = time.time()
    model.train()
    while step < a.total_steps:
        for micro, ids in enumerate(train_loader):
            inp, att, lab = (t.to(device, non_blocking=True) for t in mask_batch(ids, gen))
            sync = (micro + 1) % a.accum == 0
            with (model.no_sync() if not sync else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=inp, attention_mask=att, labels=lab).loss / a.accum
                loss.backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                l = loss.detach().float() * a.accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                dt = time.time() - t0
                t0 = time.time()
                if rank == 0:
                    sps = 100 * a.batch * a.accum * world / dt
                    print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} {sps:.0f} seq/s")
                    if run:
                        run.log({"loss": l.item(), "lr": sched.get_last_lr()[0], "seq_per_s": sps}, step=step)
            if step % 5000 == 0:
                vl = evaluate(model, val_loader, device, a.val_batches, gen)
                if rank == 0:
                    print(f"step {step} val mlm loss {vl:.4f}")
                    if run:
                        run.log({"val_loss": vl, "val_ppl": math.exp(vl)}, step=step)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step}, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()
            if step >= a.total_steps:
                break

    if run:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
