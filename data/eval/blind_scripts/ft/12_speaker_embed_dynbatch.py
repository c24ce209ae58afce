"""Speaker-embedding (TDNN + attentive statistics pooling, AAM-softmax) training on
variable-length crops with duration-budget batches and gradient accumulation.

    torchrun --nproc_per_node=4 12_speaker_embed_dynbatch.py --train-list lists/vox2_train.txt \
        --dev-list lists/vox1_o_utts.txt --trials lists/vox1_o_trials.txt --exp exp/tdnn_aam
"""
import argparse
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

SR = 16000


class UttDataset(Dataset):
    def __init__(self, entries, spk2id, max_crop_s, train=True):
        self.entries = entries  # list of (spk, path, duration_s)
        self.spk2id, self.train = spk2id, train
        self.max_crop = int(max_crop_s * SR)
        self.feat = torchaudio.transforms.MelSpectrogram(SR, n_fft=512, win_length=400, hop_length=160, n_mels=80)

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        spk, path, _ = self.entries[i]
        wav, _ = sf.read(path, dtype="float32")
        if self.train and len(wav) > self.max_crop:
            start = random.randint(0, len(wav) - self.max_crop)
            wav = wav[start:start + self.max_crop]
        x = torch.log(self.feat(torch.from_numpy(wav)) + 1e-6)
        x = x - x.mean(-1, keepdim=True)
        return x.T, self.spk2id.get(spk, -1), i


def collate(batch):
    xs, ys, idx = zip(*batch)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([x.size(0) for x in xs]),
            torch.tensor(ys), torch.tensor(idx))


class DurationBatchSampler(Sampler):
    def __init__(self, durations, max_seconds, num_replicas, rank, shuffle=True, seed=0, drop_last=True):
        self.durations = np.asarray(durations)
        self.max_seconds = max_seconds
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = np.random.default_rng(self.seed + self.epoch)
        order = np.argsort(self.durations, kind="stable")
        batches, cur, longest = [], [], 0.0
        for i in order:
            longest_new = max(longest, self.durations[i])
            if cur and longest_new * (len(cur) + 1) > self.max_seconds:
                batches.append(cur)
                cur, longest_new = [], self.durations[i]
            cur.append(int(i))
            longest = longest_new
        if cur:
            batches.append(cur)
        if self.shuffle:
            batches = [batches[k] for k in g.permutation(len(batches))]
        if self.drop_last:
            batches = batches[: len(batches) - len(batches) % self.num_replicas]
        return batches[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class TDNN(nn.Module):
    def __init__(self, n_mels=80, c=512, emb=192):
        super().__init__()
        specs = [(5, 1), (3, 2), (3, 3), (1, 1)]
        layers, in_c = [], n_mels
        for k, d in specs:
            layers += [nn.Conv1d(in_c, c, k, dilation=d, padding=d * (k - 1) // 2), nn.ReLU(), nn.BatchNorm1d(c)]
            in_c = c
        self.frame = nn.Sequential(*layers, nn.Conv1d(c, 3 * c, 1), nn.ReLU(), nn.BatchNorm1d(3 * c))
        self.att = nn.Sequential(nn.Conv1d(3 * c, 128, 1), nn.Tanh(), nn.Conv1d(128, 3 * c, 1))
        self.bn_pool = nn.BatchNorm1d(6 * c)
        self.fc = nn.Linear(6 * c, emb)
        self.bn_emb = nn.BatchNorm1d(emb)

    def forward(self, x, lens):
        h = self.frame(x.transpose(1, 2))
        mask = (torch.arange(h.size(-1), device=h.device)[None] < lens[:, None]).unsqueeze(1)
        w = self.att(h).masked_fill(~mask, float("-inf")).softmax(-1)
        mu = (w * h).sum(-1)
        sd = ((w * h * h).sum(-1) - mu * mu).clamp(min=1e-5).sqrt()
        return self.bn_emb(self.fc(self.bn_pool(torch.cat([mu, sd], 1))))


class AAMSoftmax(nn.Module):
    def __init__(self, emb, n_spk, margin=0.2, scale=30.0):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_spk, emb) * 0.01)
        self.m, self.s = margin, scale

    def forward(self, e, y):
        cos = F.linear(F.normalize(e), F.normalize(self.w)).clamp(-1 + 1e-7, 1 - 1e-7)
        target = torch.cos(torch.acos(cos) + self.m)
        onehot = F.one_hot(y, cos.size(1)).bool()
        return F.cross_entropy(self.s * torch.where(onehot, target, cos), y)


class SpeakerModel(nn.Module):
    def __init__(self, n_spk):
        super().__init__()
        self.embedder = TDNN()
        self.head = AAMSoftmax(192, n_spk)

    def forward(self, x, lens, y):
        return self.head(self.embedder(x, lens), y)


def compute_eer(scores, labels):
    order = np.argsort(-scores)
    labels = labels[order]
    tpr = np.cumsum(labels) / labels.sum()
    fpr = np.cumsum(1 - labels) / (1 - labels).sum()
    k = np.argmin(np.abs((1 - tpr) - fpr))
    return 100 * (fpr[k] + 1 - tpr[k]) / 2


def read_list(path):
    out = []
    with open(path) as f:
        for line in f:
            spk, wav, dur = line.split()
            out.append((spk, wav, float(dur)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--dev-list", required=True)
    ap.add_argument("--trials", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--max-seconds", type=float, default=400.0, help="seconds of audio per GPU micro-batch")
    ap.add_argument("--max-crop", type=float, default=6.0)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different crops / dropout per rank; the batch order comes from the sampler's own seed
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    train_entries, dev_entries = read_list(args.train_list), read_list(args.dev_list)
    speakers = sorted({spk for spk, _, _ in train_entries})
    spk2id = {s: i for i, s in enumerate(speakers)}
    train_ds = UttDataset(train_entries, spk2id, args.max_crop)
    dev_ds = UttDataset(dev_entries, spk2id, args.max_crop, train=False)
    train_sampler = DurationBatchSampler([min(d, args.max_crop) for _, _, d in train_entries], args.max_seconds,
                                         world, rank, seed=args.seed)
    dev_sampler = DurationBatchSampler([d for _, _, d in dev_entries], args.max_seconds, world, rank,
                                       shuffle=False, drop_last=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate, num_workers=8,
                              pin_memory=True, persistent_workers=True)
    dev_loader = DataLoader(dev_ds, batch_sampler=dev_sampler, collate_fn=collate, num_workers=4)

    model = SpeakerModel(len(speakers))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=2e-5)
    updates_per_epoch = math.ceil(len(train_sampler) / args.accum)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * updates_per_epoch)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        n_batches = len(train_sampler)
        for i, (x, lens, y, _) in enumerate(train_loader):
            x, lens, y = x.to(device, non_blocking=True), lens.to(device), y.to(device)
            last_micro = (i + 1) % args.accum == 0 or i + 1 == n_batches
            if last_micro:
                loss = model(x, lens, y) / args.accum
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    loss = model(x, lens, y) / args.accum
                    loss.backward()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} batch {i}/{n_batches} loss {loss.item() * args.accum:.3f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        embedder = model.module.embedder
        embedder.eval()
        embs = {}
        with torch.no_grad():
            for x, lens, _, idx in dev_loader:
                e = F.normalize(embedder(x.to(device), lens.to(device))).cpu().numpy()
                for j, k in enumerate(idx.tolist()):
                    embs[dev_entries[k][1]] = e[j]
        parts = [None] * world
        dist.all_gather_object(parts, embs)
        if rank == 0:
            all_embs = {k: v for p in parts for k, v in p.items()}
            scores, labels = [], []
            with open(args.trials) as f:
                for line in f:
                    lab, a, b = line.split()
                    scores.append(float(all_embs[a] @ all_embs[b]))
                    labels.append(int(lab))
            eer = compute_eer(np.array(scores), np.array(labels))
            print(f"epoch {epoch}: EER {eer:.3f}%", flush=True)
            os.makedirs(args.exp, exist_ok=True)
            torch.save({"embedder": model.module.embedder.state_dict(), "head": model.module.head.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch, "speakers": speakers},
                       os.path.join(args.exp, f"model_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
