"""Keyword spotting on Speech Commands v2 (35 words) by fine-tuning HuBERT-base
with a weighted-layer-sum + attentive pooling head (SUPERB-style, upstream unfrozen).

    torchrun --nproc_per_node=4 16_hubert_kws_speechcommands.py --data_root /data --exp exp/hubert_kws
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import HubertModel

LABELS = ["backward", "bed", "bird", "cat", "dog", "down", "eight", "five", "follow", "forward", "four", "go",
          "happy", "house", "learn", "left", "marvin", "nine", "no", "off", "on", "one", "right", "seven",
          "sheila", "six", "stop", "three", "tree", "two", "up", "visual", "wow", "yes", "zero"]
LABEL2ID = {l: i for i, l in enumerate(LABELS)}


def get_args():
    parser = argparse.ArgumentParser(description="HuBERT KWS")
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--exp", default="exp/hubert_kws")
    parser.add_argument("--upstream", default="facebook/hubert-base-ls960")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr_head", type=float, default=1e-3)
    parser.add_argument("--lr_upstream", type=float, default=2e-5)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class SpeechCommands(torchaudio.datasets.SPEECHCOMMANDS):
    def __init__(self, root, subset):
        super().__init__(root, download=False, subset=subset)

    def __getitem__(self, n):
        wav, sr, label, *_ = super().__getitem__(n)
        wav = wav[0]
        if wav.numel() < 16000:
            wav = F.pad(wav, (0, 16000 - wav.numel()))
        return wav[:16000], LABEL2ID[label]


class TimeShift:
    def __init__(self, max_shift=1600):
        self.max_shift = max_shift

    def __call__(self, batch):
        wavs, labels = zip(*batch)
        wavs = torch.stack(wavs)
        shift = int(torch.randint(-self.max_shift, self.max_shift + 1, ()))
        wavs = torch.roll(wavs, shift, dims=1)
        return wavs, torch.tensor(labels)


def plain_collate(batch):
    wavs, labels = zip(*batch)
    return torch.stack(wavs), torch.tensor(labels)


class HubertKWS(nn.Module):
    def __init__(self, upstream, n_classes=len(LABELS)):
        super().__init__()
        self.upstream = HubertModel.from_pretrained(upstream, layerdrop=0.0, mask_time_prob=0.05,
                                                    mask_time_length=5)
        self.upstream.feature_extractor._freeze_parameters()
        n_layers = self.upstream.config.num_hidden_layers + 1
        d = self.upstream.config.hidden_size
        self.layer_weights = nn.Parameter(torch.zeros(n_layers))
        self.proj = nn.Linear(d, 256)
        self.att = nn.Linear(256, 1)
        self.cls = nn.Linear(256, n_classes)

    def forward(self, wav):
        wav = (wav - wav.mean(-1, keepdim=True)) / (wav.std(-1, keepdim=True) + 1e-7)
        out = self.upstream(wav, output_hidden_states=True)
        hs = torch.stack(out.hidden_states, 0)  # L, B, T, D
        w = F.softmax(self.layer_weights, 0)
        h = (w[:, None, None, None] * hs).sum(0)
        h = torch.relu(self.proj(h))
        a = torch.softmax(self.att(h), dim=1)
        return self.cls((a * h).sum(1))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(3, device=device)
    for wav, y in loader:
        wav, y = wav.to(device), y.to(device)
        logits = model(wav)
        c[0] += F.cross_entropy(logits, y, reduction="sum")
        c[1] += (logits.argmax(-1) == y).sum()
        c[2] += y.numel()
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[2]).item(), (c[1] / c[2]).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    train_set = SpeechCommands(args.data_root, "training")
    valid_set = SpeechCommands(args.data_root, "validation")
    test_set = SpeechCommands(args.data_root, "testing")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, collate_fn=TimeShift(),
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, 64, sampler=DistributedSampler(valid_set, shuffle=False),
                              collate_fn=plain_collate, num_workers=4)
    test_loader = DataLoader(test_set, 64, sampler=DistributedSampler(test_set, shuffle=False),
                             collate_fn=plain_collate, num_workers=4)

    model = HubertKWS(args.upstream).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    upstream_params = [p for n, p in model.named_parameters() if n.startswith("module.upstream.") and p.requires_grad]
    head_params = [p for n, p in model.named_parameters() if not n.startswith("module.upstream.")]
    optimizer = torch.optim.AdamW([{"params": upstream_params, "lr": args.lr_upstream},
                                   {"params": head_params, "lr": args.lr_head}], weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[args.lr_upstream, args.lr_head],
                                                    total_steps=total, pct_start=0.1)

    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (wav, y) in enumerate(train_loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(wav)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if i % 100 == 0:
                logging.info(f"epoch {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f}")
        val_loss, val_acc = evaluate(model, valid_loader, device)
        logging.info(f"epoch {epoch} valid loss {val_loss:.4f} acc {val_acc * 100:.2f}% ({time.time() - t0:.0f}s)")
        if rank == 0 and val_acc > best_acc:
            best_acc = val_acc
            torch.save(model.module.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    state = torch.load(os.path.join(args.exp, "best.pt"), map_location=device)
    model.module.load_state_dict(state)
    test_loss, test_acc = evaluate(model, test_loader, device)
    logging.info(f"test acc {test_acc * 100:.2f}% (best valid {best_acc * 100:.2f}%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
