"""HuBERT pretraining on precomputed k-means labels (fairseq-style .tsv/.km),
keeping the checkpoint with the best masked-prediction accuracy on dev.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        07_hubert_base_it2.py --data /fsx/ls960 --label-dir /fsx/ls960/hubert_it2_km500 \
        --save-dir /fsx/ckpt/hubert_base_it2
"""
import argparse
import copy
import logging
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
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger("hubert")
LABEL_RATE = 50
SR = 16000
CONV_SPEC = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def feat_len(n):
    for _, k, s in CONV_SPEC:
        n = (n - k) // s + 1
    return n


class HubertDataset(Dataset):
    def __init__(self, tsv, km, max_keep=None, min_keep=32000, max_sample_size=250000):
        with open(tsv) as f:
            root = f.readline().strip()
            rows = [l.rstrip("\n").split("\t") for l in f]
        with open(km) as f:
            labels = [l.rstrip("\n") for l in f]
        assert len(rows) == len(labels), f"{tsv}: {len(rows)} utts but {len(labels)} label lines"
        keep = [i for i, (_, n) in enumerate(rows)
                if int(n) >= min_keep and (max_keep is None or int(n) <= max_keep)]
        self.paths = [os.path.join(root, rows[i][0]) for i in keep]
        self.labels = [labels[i] for i in keep]
        self.max_sample_size = max_sample_size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        wav, sr = sf.read(self.paths[i], dtype="float32")
        assert sr == SR
        lab = np.fromstring(self.labels[i], dtype=np.int64, sep=" ")
        ratio = SR // LABEL_RATE
        if len(wav) > self.max_sample_size:
            start = random.randint(0, (len(wav) - self.max_sample_size) // ratio)
            wav = wav[start * ratio:start * ratio + self.max_sample_size]
            lab = lab[start:start + self.max_sample_size // ratio]
        return torch.from_numpy(wav), torch.from_numpy(lab)


def collater(samples):
    size = min(len(w) for w, _ in samples)
    nlab = min(size // (SR // LABEL_RATE), min(len(l) for _, l in samples))
    return (torch.stack([w[:size] for w, _ in samples]),
            torch.stack([l[:nlab] for _, l in samples]))


class ConvEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        layers, c_in = [], 1
        for i, (c, k, s) in enumerate(CONV_SPEC):
            layers.append(nn.Sequential(nn.Conv1d(c_in, c, k, s, bias=False),
                                        nn.GroupNorm(c, c) if i == 0 else nn.Identity(), nn.GELU()))
            c_in = c
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        x = x[:, None]
        for l in self.layers:
            x = l(x)
        return x.transpose(1, 2)


class HuBERT(nn.Module):
    def __init__(self, num_classes, dim=768, depth=12, heads=12, final_dim=256):
        super().__init__()
        self.fe = ConvEncoder()
        self.fe_ln = nn.LayerNorm(512)
        self.post_extract_proj = nn.Linear(512, dim)
        self.mask_emb = nn.Parameter(torch.FloatTensor(dim).uniform_())
        self.pos_conv = nn.Sequential(nn.Conv1d(dim, dim, 128, padding=64, groups=16), nn.GELU())
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, activation="gelu", batch_first=True)
        self.encoder = nn.ModuleList([copy.deepcopy(block) for _ in range(depth)])
        self.enc_ln = nn.LayerNorm(dim)
        self.final_proj = nn.Linear(dim, final_dim)
        self.label_embs_concat = nn.Parameter(torch.FloatTensor(num_classes, final_dim).uniform_())

    def forward(self, source, mask_indices):
        feats = self.fe_ln(self.fe(source))
        features_pen = feats.float().pow(2).mean()
        x = self.post_extract_proj(feats)
        x = torch.where(mask_indices[..., None], self.mask_emb.type_as(x), x)
        x = self.enc_ln(x + self.pos_conv(x.transpose(1, 2))[..., :-1].transpose(1, 2))
        for blk in self.encoder:
            x = blk(x)
        proj = self.final_proj(x)
        logits = F.cosine_similarity(proj.float()[:, :, None], self.label_embs_concat.float()[None, None], -1)
        return logits / 0.1, features_pen


def compute_mask_indices(B, T, mask_prob=0.8, mask_length=10):
    mask = np.zeros((B, T), dtype=bool)
    num = int(mask_prob * T / float(mask_length) + np.random.rand())
    num = max(num, 2)
    for i in range(B):
        idc = np.random.choice(T - mask_length, num, replace=False)
        mask[i, (idc[:, None] + np.arange(mask_length)[None]).reshape(-1)] = True
    return torch.from_numpy(mask)


def masked_ce(logits, labels, mask):
    T = min(logits.size(1), labels.size(1))
    m = mask[:, :T]
    lg, lb = logits[:, :T][m], labels[:, :T][m]
    return F.cross_entropy(lg, lb, reduction="sum"), (lg.argmax(-1) == lb).sum(), lb.numel()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for wav, lab in loader:
        wav, lab = wav.to(device), lab.to(device)
        mask = compute_mask_indices(wav.size(0), feat_len(wav.size(1))).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = model(wav, mask)
        l, c, n = masked_ce(logits, lab, mask)
        loss_sum += l.item()
        correct += c.item()
        count += n
    model.train()
    return loss_sum / max(count, 1), correct / max(count, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--label-dir", required=True)
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--num-classes", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-updates", type=int, default=32000)
    ap.add_argument("--max-update", type=int, default=400000)
    ap.add_argument("--validate-interval-updates", type=int, default=10000)
    ap.add_argument("--num-workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)

    train_ds = HubertDataset(os.path.join(args.data, "train.tsv"), os.path.join(args.label_dir, "train.km"))
    valid_ds = HubertDataset(os.path.join(args.data, "valid.tsv"), os.path.join(args.label_dir, "valid.km"))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collater,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size, sampler=valid_sampler, collate_fn=collater,
                              num_workers=2)

    model = HuBERT(args.num_classes).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)

    def lr_lambda(step):
        if step < args.warmup_updates:
            return step / args.warmup_updates
        return max(0.0, (args.max_update - step) / (args.max_update - args.warmup_updates))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if rank == 0 else None

    num_updates, epoch, best_acc = 0, 0, -1.0
    t_start = time.time()
    while num_updates < args.max_update:
        train_sampler.set_epoch(epoch)
        for wav, lab in train_loader:
            wav = wav.to(device, non_blocking=True)
            lab = lab.to(device, non_blocking=True)
            mask = compute_mask_indices(wav.size(0), feat_len(wav.size(1))).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, pen = model(wav, mask)
            loss_sum, correct, n = masked_ce(logits, lab, mask)
            loss = loss_sum / n + 10.0 * pen
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            num_updates += 1

            if num_updates % 100 == 0:
                t = torch.tensor([loss.item(), correct.item() / n], device=device)
                dist.all_reduce(t)
                t /= world_size
                if rank == 0:
                    writer.add_scalar("train/loss", t[0], num_updates)
                    writer.add_scalar("train/acc_m", t[1], num_updates)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], num_updates)
                    logger.info("upd %d loss %.4f acc %.4f wps %.0f", num_updates, t[0], t[1],
                                100 * wav.numel() * world_size / (time.time() - t_start))
                    t_start = time.time()

            if num_updates % args.validate_interval_updates == 0:
                val_loss, val_acc = evaluate(model.module, valid_loader, device)
                if rank == 0:
                    writer.add_scalar("valid/loss", val_loss, num_updates)
                    writer.add_scalar("valid/acc_m", val_acc, num_updates)
                    logger.info("valid @ %d: loss %.4f acc_m %.4f", num_updates, val_loss, val_acc)
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                             "num_updates": num_updates, "args": vars(args)}
                    torch.save(state, os.path.join(args.save_dir, "checkpoint_last.pt"))
                    if val_acc > best_acc:
                        best_acc = val_acc
                        torch.save(state, os.path.join(args.save_dir, "checkpoint_best.pt"))
                dist.barrier()
            if num_updates >= args.max_update:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
