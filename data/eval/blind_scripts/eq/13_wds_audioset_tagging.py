"""
AudioSet tagging (527 classes, multi-label) from WebDataset shards of 10 s clips.

Each sample in a shard: <key>.flac (32 kHz mono) and <key>.json ({"labels": [int, ...]}).

    torchrun --nproc_per_node=4 13_wds_audioset_tagging.py \
        --train "/data/audioset_wds/unbal-{0000..2047}.tar" \
        --val "/data/audioset_wds/eval-{0000..0019}.tar" --steps 200000
"""
import argparse
import io
import json
import os
import time

import numpy as np
import soundfile as sf
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import webdataset as wds
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP

N_CLASSES = 527
SR = 32000
CLIP = 10 * SR


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--eval_every", type=int, default=5000)
    p.add_argument("--out", default="/shared/exp/audioset_effb2")
    p.add_argument("--local_rank", type=int, default=0)
    return p


def decode_sample(sample):
    wav, sr = sf.read(io.BytesIO(sample["flac"]), dtype="float32")
    if wav.ndim > 1:
        wav = wav.mean(1)
    if sr != SR:
        wav = torchaudio.functional.resample(torch.from_numpy(wav), sr, SR).numpy()
    if len(wav) < CLIP:
        wav = np.pad(wav, (0, CLIP - len(wav)))
    else:
        start = np.random.randint(0, len(wav) - CLIP + 1)
        wav = wav[start:start + CLIP]
    target = np.zeros(N_CLASSES, dtype=np.float32)
    target[json.loads(sample["json"])["labels"]] = 1.0
    return torch.from_numpy(wav), torch.from_numpy(target)


def train_loader(args):
    # resampled shards: every worker draws shards with replacement forever, so the
    # stream never ends and training is counted in steps
    ds = (wds.WebDataset(args.train, resampled=True, handler=wds.warn_and_continue)
          .shuffle(1000)
          .map(decode_sample, handler=wds.warn_and_continue)
          .batched(args.batch_size, partial=False))
    loader = wds.WebLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=True)
    return loader


def val_loader(args):
    ds = (wds.WebDataset(args.val, nodesplitter=wds.split_by_node, shardshuffle=False)
          .map(decode_sample)
          .batched(64, partial=True))
    return wds.WebLoader(ds, batch_size=None, num_workers=4)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=1024, hop_length=320, n_mels=128)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.backbone = timm.create_model("efficientnet_b2", pretrained=True, in_chans=1,
                                          num_classes=N_CLASSES, drop_rate=0.3)

    def forward(self, wav):
        with torch.autocast("cuda", enabled=False):
            spec = self.db(self.mel(wav.float())).unsqueeze(1)
        spec = (spec + 40.0) / 40.0
        return self.backbone(spec)


@torch.no_grad()
def evaluate(model, loader, device, rank, world_size):
    model.eval()
    preds, targets = [], []
    for wav, tgt in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(wav.to(device, non_blocking=True))
        preds.append(torch.sigmoid(logits.float()).cpu().numpy())
        targets.append(tgt.numpy())
    local = (np.concatenate(preds), np.concatenate(targets))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    model.train()
    if rank != 0:
        return None
    p = np.concatenate([g[0] for g in gathered])
    t = np.concatenate([g[1] for g in gathered])
    keep = t.sum(0) > 0
    return average_precision_score(t[:, keep], p[:, keep], average="macro")


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    model = Tagger()
    model.backbone = nn.SyncBatchNorm.convert_sync_batchnorm(model.backbone)
    model = DDP(model.to(device), device_ids=[args.local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps,
                                                    pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.BCEWithLogitsLoss()

    loader = train_loader(args)
    vloader = val_loader(args)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, best_map = 0, 0.0
    data = iter(loader)
    model.train()
    t0 = time.time()
    while step < args.steps:
        wav, target = next(data)
        wav = wav.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(wav), target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        step += 1

        if step % 100 == 0:
            l = loss.detach().float()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 100:.3f}s/step", flush=True)
                t0 = time.time()

        if step % args.eval_every == 0 or step == args.steps:
            mAP = evaluate(model.module, vloader, device, rank, world_size)
            if rank == 0:
                print(f"step {step} val mAP {mAP:.4f}")
                torch.save(model.module.state_dict(), os.path.join(args.out, "last.pt"))
                if mAP > best_map:
                    best_map = mAP
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
