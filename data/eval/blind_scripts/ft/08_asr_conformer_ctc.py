"""Conformer-CTC training with dynamic (frame-budget) batches.

Example:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        08_asr_conformer_ctc.py --data-dir /shared/librispeech --exp /shared/exp/conformer_s
"""
import argparse
import json
import math
import os

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def load_manifest(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


def frame_counts(items, cache_file):
    """Number of 10ms frames per utterance. Built once by global rank 0, then read by everyone."""
    if dist.get_rank() == 0 and not os.path.exists(cache_file):
        counts = [sf.info(it["audio"]).frames // 160 + 1 for it in items]
        tmp = cache_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(counts, f)
        os.replace(tmp, cache_file)
    dist.barrier()
    with open(cache_file) as f:
        return json.load(f)


class AudioTextDataset(Dataset):
    def __init__(self, items, token2id):
        self.items, self.token2id = items, token2id
        self.fbank = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160,
                                                          n_mels=80)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        wav, _ = sf.read(self.items[i]["audio"], dtype="float32")
        x = torch.log(self.fbank(torch.from_numpy(wav)) + 1e-6).T
        y = torch.tensor([self.token2id[c] for c in self.items[i]["text"]], dtype=torch.long)
        return x, y


def collate(batch):
    xs, ys = zip(*batch)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([len(x) for x in xs]),
            nn.utils.rnn.pad_sequence(ys, batch_first=True), torch.tensor([len(y) for y in ys]))


class FrameBudgetSampler(Sampler):
    def __init__(self, frames, max_frames, num_replicas, rank, shuffle, seed=0, even=True):
        self.frames, self.max_frames = frames, max_frames
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.even, self.epoch = shuffle, seed, even, 0
        order = sorted(range(len(frames)), key=frames.__getitem__)
        self.batches, cur = [], []
        for i in order:
            if cur and frames[i] * (len(cur) + 1) > max_frames:
                self.batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            self.batches.append(cur)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        batches = self.batches
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g)]
        if self.even:
            batches = batches[: len(batches) // self.num_replicas * self.num_replicas]
        return iter(batches[self.rank::self.num_replicas])

    def __len__(self):
        if self.even:
            return len(self.batches) // self.num_replicas
        return len(self.batches[self.rank::self.num_replicas])


class ConvModule(nn.Module):
    def __init__(self, d, kernel=31):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.bn = nn.BatchNorm1d(d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x):
        y = nn.functional.glu(self.pw1(self.ln(x).transpose(1, 2)), dim=1)
        y = self.pw2(nn.functional.silu(self.bn(self.dw(y))))
        return y.transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d, heads, dropout=0.1):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(dropout), nn.Linear(4 * d, d))
        self.ln_att = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.conv = ConvModule(d)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(dropout), nn.Linear(4 * d, d))
        self.ln_out = nn.LayerNorm(d)

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.ff1(x)
        h = self.ln_att(x)
        x = x + self.att(h, h, h, key_padding_mask=pad_mask, need_weights=False)[0]
        x = x + self.conv(x.masked_fill(pad_mask[..., None], 0.0))
        x = x + 0.5 * self.ff2(x)
        return self.ln_out(x)


class ConformerCTC(nn.Module):
    def __init__(self, vocab, d=256, heads=4, layers=16):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.proj = nn.Linear(d * 19, d)
        self.blocks = nn.ModuleList(ConformerBlock(d, heads) for _ in range(layers))
        self.out = nn.Linear(d, vocab)

    def forward(self, x, lens):
        x = self.sub(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        pad = torch.arange(t, device=x.device)[None] >= lens[:, None]
        for blk in self.blocks:
            x = blk(x, pad)
        return self.out(x).log_softmax(-1), lens


def wer(hyps, refs):
    errs = sum(torchaudio.functional.edit_distance(h.split(), r.split()) for h, r in zip(hyps, refs))
    return errs / max(1, sum(len(r.split()) for r in refs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--max-frames", type=int, default=60000)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--peak-lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=15000)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_items = load_manifest(os.path.join(args.data_dir, "train_960.jsonl"))
    dev_items = load_manifest(os.path.join(args.data_dir, "dev_clean.jsonl"))
    # char vocabulary: built on rank 0 and broadcast so every rank uses exactly the same ids
    vocab = [None]
    if rank == 0:
        vocab[0] = ["<blank>"] + sorted({c for it in train_items for c in it["text"]})
    dist.broadcast_object_list(vocab, src=0)
    vocab = vocab[0]
    token2id = {c: i for i, c in enumerate(vocab)}

    train_frames = frame_counts(train_items, os.path.join(args.data_dir, "train_960.frames.json"))
    dev_frames = frame_counts(dev_items, os.path.join(args.data_dir, "dev_clean.frames.json"))
    train_sampler = FrameBudgetSampler(train_frames, args.max_frames, world, rank, shuffle=True, seed=args.seed)
    dev_sampler = FrameBudgetSampler(dev_frames, args.max_frames, world, rank, shuffle=False, even=False)
    train_loader = DataLoader(AudioTextDataset(train_items, token2id), batch_sampler=train_sampler,
                              collate_fn=collate, num_workers=8, pin_memory=True, persistent_workers=True)
    dev_loader = DataLoader(AudioTextDataset(dev_items, token2id), batch_sampler=dev_sampler,
                            collate_fn=collate, num_workers=4)

    model = ConformerCTC(len(vocab))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3)
    noam = lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam)
    start_epoch = 0
    ckpt_path = os.path.join(args.exp, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank])
    ctc_loss = nn.CTCLoss(blank=0, zero_infinity=True)

    if rank == 0:
        wandb.init(project="conformer-ctc", name=os.path.basename(args.exp), config=vars(args), resume="allow")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (x, xl, y, yl) in enumerate(train_loader):
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp, out_lens = model(x, xl)
            loss = ctc_loss(logp.float().transpose(0, 1), y, out_lens, yl)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0], "epoch": epoch})

        # each rank decodes its share of dev; transcripts are gathered as Python objects
        model.eval()
        hyps, refs = [], []
        with torch.no_grad():
            for x, xl, y, yl in dev_loader:
                logp, out_lens = model.module(x.to(device), xl.to(device))
                for seq, n, ref, rn in zip(logp.argmax(-1).cpu(), out_lens.cpu(), y, yl):
                    ids = [t for t in torch.unique_consecutive(seq[:n]).tolist() if t != 0]
                    hyps.append("".join(vocab[t] for t in ids))
                    refs.append("".join(vocab[t] for t in ref[:rn].tolist()))
        gathered = [None] * world
        dist.all_gather_object(gathered, (hyps, refs))
        if rank == 0:
            all_h = [h for hs, _ in gathered for h in hs]
            all_r = [r for _, rs in gathered for r in rs]
            dev_wer = wer(all_h, all_r)
            print(f"epoch {epoch}: dev WER {100 * dev_wer:.2f}% on {len(all_r)} utts", flush=True)
            wandb.log({"dev/wer": dev_wer, "epoch": epoch})
            os.makedirs(args.exp, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "vocab": vocab},
                       os.path.join(args.exp, "last.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
