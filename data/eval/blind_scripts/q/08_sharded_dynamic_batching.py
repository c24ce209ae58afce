#!/usr/bin/env python3
"""CRDNN-CTC recipe on pre-sharded training data.

Training data lives in shards written by prepare_shards.py (data/shards/train-XXXXX.pt, each a list of
{"id", "feats": FloatTensor[T, 80], "tokens": LongTensor[U]}). Each rank reads its own shards and builds
batches by total frames.

torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=node01:29500 \
    08_sharded_dynamic_batching.py --shards "data/shards/train-*.pt" --valid data/shards/dev.pt
"""
import argparse
import glob
import logging
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger(__name__)

HPARAMS = {
    "n_mels": 80,
    "vocab": 500,  # unigram 500 + blank at 0
    "cnn_channels": 128,
    "rnn_neurons": 512,
    "rnn_layers": 4,
    "dnn_neurons": 512,
    "max_frames_per_batch": 24000,
    "lr": 1.0,
    "epochs": 25,
    "grad_clip": 5.0,
}


class ShardedFrameBatcher(IterableDataset):
    def __init__(self, shard_files, max_frames, shuffle=True, seed=0):
        super().__init__()
        self.shard_files = shard_files
        self.max_frames = max_frames
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        files = list(self.shard_files)
        if self.shuffle:
            rng.shuffle(files)
        for f in files:
            utts = torch.load(f)
            utts.sort(key=lambda u: u["feats"].size(0))
            batches, cur, longest = [], [], 0
            for u in utts:
                T = u["feats"].size(0)
                if cur and max(longest, T) * (len(cur) + 1) > self.max_frames:
                    batches.append(cur)
                    cur, longest = [], 0
                cur.append(u)
                longest = max(longest, T)
            if cur:
                batches.append(cur)
            if self.shuffle:
                rng.shuffle(batches)
            for b in batches:
                yield collate(b)


def collate(utts):
    feats = [u["feats"] for u in utts]
    toks = [u["tokens"] for u in utts]
    return (nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor([f.size(0) for f in feats]),
            nn.utils.rnn.pad_sequence(toks, batch_first=True), torch.tensor([t.size(0) for t in toks]))


class CRDNN(nn.Module):
    def __init__(self, hp):
        super().__init__()
        c = hp["cnn_channels"]
        self.cnn = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.LeakyReLU(),
            nn.MaxPool2d((1, 2)),
            nn.Conv2d(c, c, 3, padding=1), nn.LeakyReLU(), nn.MaxPool2d((2, 2)),
        )
        freq = hp["n_mels"] // 4
        self.rnn = nn.LSTM(c * freq, hp["rnn_neurons"], hp["rnn_layers"], batch_first=True,
                           bidirectional=True, dropout=0.15)
        self.dnn = nn.Sequential(nn.Linear(2 * hp["rnn_neurons"], hp["dnn_neurons"]),
                                 nn.LayerNorm(hp["dnn_neurons"]), nn.LeakyReLU(), nn.Dropout(0.15))
        self.ctc_lin = nn.Linear(hp["dnn_neurons"], hp["vocab"] + 1)

    def forward(self, x, lens):
        x = self.cnn(x.unsqueeze(1))  # B, C, T/2, F/4
        B, C, T, Fq = x.shape
        x = x.permute(0, 2, 1, 3).reshape(B, T, C * Fq)
        lens = torch.div(lens, 2, rounding_mode="floor").clamp(min=1, max=T)
        x = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        x, _ = self.rnn(x)
        x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True, total_length=T)
        return self.ctc_lin(self.dnn(x)).log_softmax(-1), lens


class Brain:
    def __init__(self, hp, device, rank):
        self.hp = hp
        self.device = device
        self.rank = rank
        model = CRDNN(hp).to(device)
        self.modules = DistributedDataParallel(model, device_ids=[device.index])
        self.optimizer = torch.optim.Adadelta(self.modules.parameters(), lr=hp["lr"], rho=0.95, eps=1e-8)
        self.step = 0

    def compute_loss(self, batch):
        x, xl, y, yl = [t.to(self.device, non_blocking=True) for t in batch]
        logp, ol = self.modules(x, xl)
        return F.ctc_loss(logp.transpose(0, 1), y, ol, yl, blank=0, zero_infinity=True)

    def fit_batch(self, batch):
        loss = self.compute_loss(batch)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.modules.parameters(), self.hp["grad_clip"])
        self.optimizer.step()
        self.step += 1
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, valid_utts):
        net = self.modules.module
        net.eval()
        mine = valid_utts[self.rank::dist.get_world_size()]
        tot = torch.zeros(2, device=self.device)
        for i in range(0, len(mine), 16):
            x, xl, y, yl = [t.to(self.device) for t in collate(mine[i:i + 16])]
            logp, ol = net(x, xl)
            tot[0] += F.ctc_loss(logp.transpose(0, 1), y, ol, yl, zero_infinity=True, reduction="sum")
            tot[1] += x.size(0)
        dist.all_reduce(tot)
        net.train()
        return (tot[0] / tot[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", required=True)
    parser.add_argument("--valid", required=True)
    parser.add_argument("--output-folder", default="results/crdnn_ctc")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)

    all_shards = sorted(glob.glob(args.shards))
    my_shards = all_shards[rank::world]
    train_set = ShardedFrameBatcher(my_shards, HPARAMS["max_frames_per_batch"], seed=2023 + rank)
    train_loader = DataLoader(train_set, batch_size=None, num_workers=1, pin_memory=True)
    valid_utts = torch.load(args.valid)

    brain = Brain(HPARAMS, device, rank)
    writer = None
    if rank == 0:
        os.makedirs(args.output_folder, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output_folder, "tb"))
        logger.info(f"{len(all_shards)} shards, {len(my_shards)} on rank 0, world {world}")

    best = float("inf")
    for epoch in range(1, HPARAMS["epochs"] + 1):
        train_set.set_epoch(epoch)
        run_loss, n = 0.0, 0
        for batch in train_loader:
            loss = brain.fit_batch(batch)
            run_loss += loss.item()
            n += 1
            if writer is not None and brain.step % 100 == 0:
                writer.add_scalar("train/ctc", loss.item(), brain.step)

        valid_loss = brain.evaluate(valid_utts)
        if rank == 0:
            logger.info(f"epoch {epoch}: train loss {run_loss / max(n, 1):.3f} ({n} batches) valid loss {valid_loss:.3f}")
            writer.add_scalar("valid/ctc", valid_loss, epoch)
            ckpt = {"model": brain.modules.module.state_dict(), "optimizer": brain.optimizer.state_dict(),
                    "epoch": epoch, "step": brain.step}
            torch.save(ckpt, os.path.join(args.output_folder, "CKPT_last.pt"))
            if valid_loss < best:
                best = valid_loss
                torch.save(ckpt, os.path.join(args.output_folder, "CKPT_best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
