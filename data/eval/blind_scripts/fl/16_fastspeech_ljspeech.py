"""Non-autoregressive TTS acoustic model (FastSpeech-style) on LJSpeech.

Expects preprocessed features: <feat_dir>/{mel,duration}/<utt>.npy and a metadata file
with "utt|phoneme ids separated by spaces". Durations come from forced alignment.

    deepspeed --num_gpus 4 16_fastspeech_ljspeech.py --feat-dir /data/ljspeech_feats --out exp/fs_lj
"""
import argparse
import math
import os

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_MELS = 80
N_PHONES = 80


class LJFeatures(Dataset):
    def __init__(self, feat_dir, meta):
        self.feat_dir = feat_dir
        with open(os.path.join(feat_dir, meta)) as f:
            rows = [l.rstrip("\n").split("|") for l in f if l.strip()]
        self.items = [(utt, [int(t) for t in ph.split()]) for utt, ph in rows]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        utt, phones = self.items[i]
        mel = np.load(os.path.join(self.feat_dir, "mel", utt + ".npy"))
        dur = np.load(os.path.join(self.feat_dir, "duration", utt + ".npy"))
        return torch.tensor(phones), torch.from_numpy(dur).long(), torch.from_numpy(mel).float()


def collate(batch):
    phones, durs, mels = zip(*batch)
    return (pad_sequence(phones, batch_first=True), torch.tensor([len(p) for p in phones]),
            pad_sequence(durs, batch_first=True), pad_sequence(mels, batch_first=True),
            torch.tensor([m.size(0) for m in mels]))


class PositionalEncoding(nn.Module):
    def __init__(self, d, max_len=4000):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)].to(x.dtype)


class FastSpeech(nn.Module):
    def __init__(self, d=384, heads=2, layers=6, ffn=1536):
        super().__init__()
        self.embed = nn.Embedding(N_PHONES, d, padding_idx=0)
        self.pos = PositionalEncoding(d)
        enc_layer = nn.TransformerEncoderLayer(d, heads, ffn, 0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.decoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, ffn, 0.1, batch_first=True), layers)
        self.dur_pred = nn.Sequential(nn.Conv1d(d, 256, 3, padding=1), nn.ReLU(),
                                      nn.Conv1d(256, 256, 3, padding=1), nn.ReLU(), nn.Conv1d(256, 1, 1))
        self.mel_out = nn.Linear(d, N_MELS)
        self.postnet = nn.Sequential(*[nn.Sequential(nn.Conv1d(N_MELS if i == 0 else 512, 512 if i < 4 else N_MELS,
                                                               5, padding=2), nn.Tanh() if i < 4 else nn.Identity())
                                       for i in range(5)])

    @staticmethod
    def length_regulate(h, durs, max_len):
        out = [torch.repeat_interleave(h[b], durs[b], dim=0) for b in range(h.size(0))]
        out = pad_sequence(out, batch_first=True)
        return out[:, :max_len] if out.size(1) >= max_len else F.pad(out, (0, 0, 0, max_len - out.size(1)))

    def forward(self, phones, phone_lens, durs, mel_len_max):
        pmask = torch.arange(phones.size(1), device=phones.device)[None] >= phone_lens[:, None]
        h = self.encoder(self.pos(self.embed(phones)), src_key_padding_mask=pmask)
        log_dur = self.dur_pred(h.transpose(1, 2)).squeeze(1)
        x = self.pos(self.length_regulate(h, durs, mel_len_max))
        x = self.decoder(x)
        mel = self.mel_out(x)
        mel_post = mel + self.postnet(mel.transpose(1, 2)).transpose(1, 2)
        return mel, mel_post, log_dur, pmask


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--feat-dir", required=True)
    ap.add_argument("--out", default="exp/fastspeech")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.0, help="noam scale")
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


def masked_l1(pred, target, lens):
    mask = (torch.arange(target.size(1), device=target.device)[None] < lens[:, None]).unsqueeze(-1)
    return (F.l1_loss(pred.float(), target, reduction="none") * mask).sum() / (mask.sum() * target.size(-1))


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()

    train_set = LJFeatures(args.feat_dir, "train.txt")
    val_set = LJFeatures(args.feat_dir, "val.txt")
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=4, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=16, sampler=DistributedSampler(val_set, shuffle=False),
                            collate_fn=collate, num_workers=2)

    model = FastSpeech()
    d_model = 384
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    noam = lambda step: d_model ** -0.5 * min((step + 1) ** -0.5, (step + 1) * args.warmup ** -1.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, noam)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.98], "eps": 1e-9,
                                                  "weight_decay": 0.0}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 500,
    }
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                           lr_scheduler=scheduler, config=ds_config)
    os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for step, (phones, plens, durs, mels, mlens) in enumerate(train_loader):
            phones, plens, durs = phones.to(engine.device), plens.to(engine.device), durs.to(engine.device)
            mels, mlens = mels.to(engine.device), mlens.to(engine.device)
            mel, mel_post, log_dur, pmask = engine(phones, plens, durs, mels.size(1))
            dur_target = torch.log(durs.float() + 1.0)
            dur_loss = F.mse_loss(log_dur.float().masked_select(~pmask), dur_target.masked_select(~pmask))
            loss = masked_l1(mel, mels, mlens) + masked_l1(mel_post, mels, mlens) + dur_loss
            engine.backward(loss)
            engine.step()
            if rank == 0 and engine.global_steps % 100 == 0:
                print(f"epoch {epoch} step {engine.global_steps} loss {loss.item():.4f} "
                      f"dur {dur_loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        engine.eval()
        tot = torch.zeros(2, device=engine.device)
        with torch.no_grad():
            for phones, plens, durs, mels, mlens in val_loader:
                phones, plens, durs = phones.to(engine.device), plens.to(engine.device), durs.to(engine.device)
                mels, mlens = mels.to(engine.device), mlens.to(engine.device)
                _, mel_post, _, _ = engine(phones, plens, durs, mels.size(1))
                tot[0] += masked_l1(mel_post, mels, mlens) * phones.size(0)
                tot[1] += phones.size(0)
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch}: val mel L1 {(tot[0] / tot[1]).item():.4f}", flush=True)

        if (epoch + 1) % args.save_every == 0:
            engine.save_checkpoint(args.out, tag=f"epoch{epoch + 1}", client_state={"epoch": epoch})
            if rank == 0:
                torch.save({k: v.float().cpu() for k, v in engine.module.state_dict().items()},
                           os.path.join(args.out, f"fastspeech_e{epoch + 1}.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
