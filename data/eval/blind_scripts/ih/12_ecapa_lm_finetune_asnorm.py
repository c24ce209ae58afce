"""Large-margin fine-tuning of a pretrained ECAPA-TDNN + AS-norm evaluation.

Stage 2 of the ECAPA recipe: 6 s crops, margin 0.5, no augmentation, low lr.
With 6 s crops only 16 utterances fit per GPU, so BatchNorm is synchronised
across GPUs and gradients are accumulated over 4 micro-batches.

    torchrun --nproc_per_node=8 12_ecapa_lm_finetune_asnorm.py \
        --init exp/ecapa_c1024/last.pt --out exp/ecapa_c1024_lm
"""
import argparse
import contextlib
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from sv.model import ECAPATDNN, AAMSoftmax
from sv.metrics import eer_mindcf


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--init", required=True)
    p.add_argument("--train-list", default="data/vox2_dev/train.list")
    p.add_argument("--spk2id", default="data/vox2_dev/spk2id")
    p.add_argument("--trials", default="data/vox1/vox1_O_cleaned.txt")
    p.add_argument("--eval-root", default="data/vox1/wav")
    p.add_argument("--out", default="exp/ecapa_c1024_lm")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4, help="for a global batch of 512")
    p.add_argument("--margin", type=float, default=0.5)
    p.add_argument("--crop", type=float, default=6.0)
    p.add_argument("--cohort-spk", type=int, default=3000)
    p.add_argument("--topk", type=int, default=300)
    return p.parse_args()


class Crops(Dataset):
    def __init__(self, list_file, spk2id, seconds):
        self.items = [(p, spk2id[s]) for p, s in (l.split() for l in open(list_file))]
        self.n = int(seconds * 16000)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        info = sf.info(path)
        start = random.randint(0, max(0, info.frames - self.n))
        wav, _ = sf.read(path, start=start, frames=self.n, dtype="float32")
        if len(wav) < self.n:
            wav = np.pad(wav, (0, self.n - len(wav)), mode="wrap")
        return torch.from_numpy(wav), y


class Net(nn.Module):
    def __init__(self, n_spk, margin):
        super().__init__()
        self.encoder = ECAPATDNN(C=1024, emb_dim=192)
        self.head = AAMSoftmax(192, n_spk, m=margin, s=30.0)

    def forward(self, wav, y):
        return self.head(self.encoder(wav), y)


@torch.no_grad()
def embed_paths(encoder, paths, device, rank, world, max_sec=None):
    """Embeds paths[rank::world] on this rank and returns {path: emb} for all paths on every rank."""
    encoder.eval()
    mine = {}
    for p in paths[rank::world]:
        wav, _ = sf.read(p, dtype="float32")
        if max_sec:
            wav = wav[: int(max_sec * 16000)]
        e = encoder(torch.from_numpy(wav)[None].to(device))
        mine[p] = F.normalize(e, dim=-1)[0].cpu()
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def build_cohort(encoder, items, n_spk, device, rank, world, per_spk=5):
    rng = random.Random(0)  # same cohort on every rank
    by_spk = {}
    for path, y in items:
        by_spk.setdefault(y, []).append(path)
    chosen = sorted(rng.sample(sorted(by_spk), n_spk))
    paths = [p for y in chosen for p in sorted(by_spk[y])[:per_spk]]
    embs = embed_paths(encoder, paths, device, rank, world, max_sec=10)
    cohort = torch.stack([F.normalize(torch.stack([embs[p] for p in sorted(by_spk[y])[:per_spk]]).mean(0), dim=0)
                          for y in chosen])
    return cohort


def asnorm(enroll, test, cohort, topk):
    s = (enroll * test).sum(-1)
    ec = enroll @ cohort.T
    tc = test @ cohort.T
    ec_top = ec.topk(topk, dim=-1).values
    tc_top = tc.topk(topk, dim=-1).values
    return 0.5 * ((s - ec_top.mean(-1)) / ec_top.std(-1) + (s - tc_top.mean(-1)) / tc_top.std(-1))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    spk2id = {s: int(i) for s, i in (l.split() for l in open(args.spk2id))}
    data = Crops(args.train_list, spk2id, args.crop)
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    net = Net(len(spk2id), args.margin)
    ckpt = torch.load(args.init, map_location="cpu")
    state = ckpt.get("model", ckpt)
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    net.load_state_dict(state)  # same training speakers as stage 1, head included
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    global_batch = args.micro_batch * args.accum * world
    lr = args.lr * global_batch / 512
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=2e-5)
    steps = args.epochs * (len(loader) // args.accum)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=lr * 0.05)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {global_batch}, lr {lr:.2e}, {steps} updates", flush=True)

    trials = [l.split() for l in open(args.trials)]
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic, run = time.time(), torch.zeros(2, device=device)
        opt.zero_grad(set_to_none=True)
        usable = (len(loader) // args.accum) * args.accum
        for i, (wav, y) in enumerate(loader):
            if i >= usable:
                break
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                loss, acc = model(wav, y)
                (loss / args.accum).backward()
            run += torch.stack([loss.detach(), acc.detach()])
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        dist.all_reduce(run)
        run /= usable * world
        if rank == 0:
            print(f"epoch {epoch} loss {run[0]:.4f} acc {100 * run[1]:.2f}% {time.time() - tic:.0f}s", flush=True)

        encoder = model.module.encoder
        cohort = build_cohort(encoder, data.items, args.cohort_spk, device, rank, world)
        utts = sorted({u for t in trials for u in t[1:]})
        embs = embed_paths(encoder, [os.path.join(args.eval_root, u) for u in utts], device, rank, world)
        if rank == 0:
            e = torch.stack([embs[os.path.join(args.eval_root, t[1])] for t in trials])
            t = torch.stack([embs[os.path.join(args.eval_root, t[2])] for t in trials])
            labels = np.array([int(x[0]) for x in trials])
            raw = (e * t).sum(-1).numpy()
            normed = torch.cat([asnorm(e[j:j + 4096], t[j:j + 4096], cohort, args.topk)
                                for j in range(0, len(trials), 4096)]).numpy()
            (eer_raw, _), (eer_as, dcf_as) = eer_mindcf(raw, labels), eer_mindcf(normed, labels)
            print(f"epoch {epoch} Vox1-O EER cos {eer_raw:.3f}% | AS-norm {eer_as:.3f}% minDCF {dcf_as:.4f}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"lm_epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
