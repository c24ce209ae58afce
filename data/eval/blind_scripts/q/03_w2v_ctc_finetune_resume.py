# Fine-tune a pretrained wav2vec-style encoder with a CTC head on labelled speech.
# Written for torchrun; resumes automatically from <save_dir>/checkpoint_last.pt (preemptible queue).
import argparse
import glob
import json
import math
import os
import random

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

VOCAB = ["<pad>", "|", "'"] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest-dir", required=True)
    ap.add_argument("--pretrained", required=True, help="pretrained encoder checkpoint")
    ap.add_argument("--save-dir", default="exp/w2v_ctc_100h")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-sec", type=float, default=15.0)
    ap.add_argument("--max-updates", type=int, default=80000)
    ap.add_argument("--freeze-updates", type=int, default=10000)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--save-interval", type=int, default=2000)
    ap.add_argument("--fp16", action="store_true")
    return ap.parse_args()


class AudioCTCDataset(Dataset):
    def __init__(self, manifest, max_sec=None, sr=16000):
        with open(manifest) as f:
            rows = [json.loads(l) for l in f]
        if max_sec:
            rows = [r for r in rows if r["duration"] <= max_sec]
        self.rows = rows
        self.sr = sr

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = sf.read(r["audio"], dtype="float32")
        assert sr == self.sr
        wav = torch.from_numpy(wav)
        wav = (wav - wav.mean()) / (wav.std() + 1e-7)
        text = r["text"].upper().replace(" ", "|")
        return wav, torch.tensor([CHAR2ID[c] for c in text if c in CHAR2ID])


def collate(batch):
    wavs, labels = zip(*batch)
    wl = torch.tensor([w.numel() for w in wavs])
    ll = torch.tensor([l.numel() for l in labels])
    wavs = nn.utils.rnn.pad_sequence(wavs, batch_first=True)
    labels = nn.utils.rnn.pad_sequence(labels, batch_first=True)
    return wavs, wl, labels, ll


class ConvFeatureExtractor(nn.Module):
    # (kernel, stride) as in wav2vec 2.0 -> 320x downsampling
    LAYERS = [(10, 5), (3, 2), (3, 2), (3, 2), (3, 2), (2, 2), (2, 2)]

    def __init__(self, dim=512):
        super().__init__()
        blocks, cin = [], 1
        for k, s in self.LAYERS:
            blocks += [nn.Conv1d(cin, dim, k, stride=s, bias=False), nn.GroupNorm(dim, dim) if cin == 1 else nn.Identity(), nn.GELU()]
            cin = dim
        self.net = nn.Sequential(*blocks)

    def out_lengths(self, n):
        for k, s in self.LAYERS:
            n = torch.div(n - k, s, rounding_mode="floor") + 1
        return n

    def forward(self, wav):
        return self.net(wav.unsqueeze(1)).transpose(1, 2)


class Wav2VecCTC(nn.Module):
    def __init__(self, vocab_size, dim=768, layers=12):
        super().__init__()
        self.feature_extractor = ConvFeatureExtractor()
        self.post_proj = nn.Linear(512, dim)
        self.layer_norm = nn.LayerNorm(dim)
        layer = nn.TransformerEncoderLayer(dim, 12, 3072, 0.1, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.final_dropout = nn.Dropout(0.1)
        self.ctc_head = nn.Linear(dim, vocab_size)

    def forward(self, wav, wav_lens):
        feats = self.feature_extractor(wav)
        lens = self.feature_extractor.out_lengths(wav_lens)
        pad_mask = torch.arange(feats.size(1), device=wav.device)[None, :] >= lens[:, None]
        x = self.layer_norm(self.post_proj(feats))
        x = self.encoder(x, src_key_padding_mask=pad_mask)
        return self.ctc_head(self.final_dropout(x)), lens


def tri_stage_lr(step, total, peak):
    warm, hold = int(0.1 * total), int(0.4 * total)
    if step < warm:
        return peak * step / warm
    if step < warm + hold:
        return peak
    return peak * math.exp(math.log(0.05) * (step - warm - hold) / max(1, total - warm - hold))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(1234 + rank)
    torch.manual_seed(1234)

    train_ds = AudioCTCDataset(os.path.join(args.manifest_dir, "train_100h.jsonl"), args.max_sec)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)

    model = Wav2VecCTC(len(VOCAB))
    pre = torch.load(args.pretrained, map_location="cpu")
    missing, unexpected = model.load_state_dict(pre["model"], strict=False)
    if rank == 0:
        print(f"loaded pretrained encoder; missing={missing} unexpected={len(unexpected)}")
    # conv feature extractor stays frozen during fine-tuning (feature_grad_mult=0)
    model.feature_extractor.requires_grad_(False)
    model.to(device)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    scaler = GradScaler(enabled=args.fp16)
    update, epoch = 0, 0

    last = os.path.join(args.save_dir, "checkpoint_last.pt")
    if os.path.isfile(last):
        ckpt = torch.load(last)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        update, epoch = ckpt["update"], ckpt["epoch"]
        if rank == 0:
            print(f"resumed from {last} at update {update}")

    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=False)
    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if rank == 0 else None

    while update < args.max_updates:
        sampler.set_epoch(epoch)
        for wavs, wl, labels, ll in loader:
            wavs, wl = wavs.to(device, non_blocking=True), wl.to(device)
            labels, ll = labels.to(device), ll.to(device)
            for g in optimizer.param_groups:
                g["lr"] = tri_stage_lr(update, args.max_updates, args.lr)
            freeze = update < args.freeze_updates
            with autocast(enabled=args.fp16):
                logits, ol = ddp(wavs, wl)
            lprobs = F.log_softmax(logits.float(), dim=-1).transpose(0, 1)
            loss = F.ctc_loss(lprobs, labels, ol, ll, blank=0, zero_infinity=True, reduction="mean")
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            gn = nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            if freeze:
                # only the CTC head is trained for the first updates
                for n, p in ddp.module.named_parameters():
                    if not n.startswith("ctc_head"):
                        p.grad = None
            scaler.step(optimizer)
            scaler.update()
            update += 1

            if rank == 0 and update % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), update)
                writer.add_scalar("train/gnorm", gn.item(), update)
                writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], update)
                writer.add_scalar("train/scale", scaler.get_scale(), update)
            if update % args.save_interval == 0:
                if rank == 0:
                    os.makedirs(args.save_dir, exist_ok=True)
                    state = {"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "update": update, "epoch": epoch}
                    torch.save(state, last + ".tmp")
                    os.replace(last + ".tmp", last)
                dist.barrier()
            if update >= args.max_updates:
                break
        epoch += 1

    if rank == 0:
        torch.save({"model": ddp.module.state_dict()}, os.path.join(args.save_dir, "final.pt"))
        for f in glob.glob(os.path.join(args.save_dir, "*.tmp")):
            os.remove(f)
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
