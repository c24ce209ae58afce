#!/usr/bin/env python3
"""AVSR on a new in-house corpus of talking-head recordings (raw .mp4, no landmarks provided).

Step 1 (first run only): detect landmarks with face_alignment on the GPU, crop 96x96 mouth ROIs,
         extract 16 kHz audio; results go to a cache directory on the shared filesystem.
         The clip list is split across all ranks of the job, each rank writes only its own clips.
Step 2: hybrid CTC/attention training with automatic resume.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        13_avsr_cache_and_resume.py --clips /shared/corpus/clips.tsv --cache /shared/corpus/roi_cache \
        --exp /shared/exp/avsr_inhouse
"""
import argparse
import datetime
import json
import math
import os
import time

import cv2
import editdistance
import face_alignment
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def read_clips(path):
    with open(path) as f:
        return [dict(zip(("id", "mp4", "split", "text"), l.rstrip("\n").split("\t"))) for l in f]


def cache_shard(clips, cache_dir, rank, world, device):
    """Crop the clips assigned to this rank; writes <id>.npy/<id>.wav atomically and a per-rank index."""
    index_file = os.path.join(cache_dir, f"index.rank{rank:03d}-of-{world:03d}.json")
    if os.path.exists(index_file):
        return
    fa = face_alignment.FaceAlignment(face_alignment.LandmarksType.TWO_D, device=str(device), flip_input=False)
    ok_ids = []
    for n, c in enumerate(clips[rank::world]):
        v_out, a_out = os.path.join(cache_dir, c["id"] + ".npy"), os.path.join(cache_dir, c["id"] + ".wav")
        if not (os.path.exists(v_out) and os.path.exists(a_out)):
            cap = cv2.VideoCapture(c["mp4"])
            frames = []
            while True:
                ok, img = cap.read()
                if not ok:
                    break
                frames.append(img)
            cap.release()
            rois, last = [], None
            for img in frames:
                lm = fa.get_landmarks_from_image(img[:, :, ::-1])
                if lm:
                    last = lm[0][48:68].mean(0)
                if last is None:
                    continue
                cx, cy = int(last[0]), int(last[1])
                gray = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
                gray = cv2.copyMakeBorder(gray, 48, 48, 48, 48, cv2.BORDER_REPLICATE)
                rois.append(gray[cy:cy + 96, cx:cx + 96])
            if len(rois) < 0.9 * max(1, len(frames)):
                continue  # face lost in too many frames
            os.makedirs(os.path.dirname(v_out), exist_ok=True)
            tmp = v_out + f".tmp{rank}.npy"
            np.save(tmp, np.stack(rois))
            os.replace(tmp, v_out)
            wav, sr = torchaudio.load(c["mp4"])
            tmp = a_out + f".tmp{rank}.wav"
            torchaudio.save(tmp, torchaudio.functional.resample(wav.mean(0, keepdim=True), sr, 16000), 16000)
            os.replace(tmp, a_out)
        ok_ids.append(c["id"])
        if n % 500 == 0:
            print(f"[rank {rank}] cached {n}/{len(clips[rank::world])}", flush=True)
    del fa
    torch.cuda.empty_cache()
    with open(index_file + ".tmp", "w") as f:
        json.dump(ok_ids, f)
    os.replace(index_file + ".tmp", index_file)


def load_index(cache_dir, world):
    ok = set()
    for r in range(world):
        with open(os.path.join(cache_dir, f"index.rank{r:03d}-of-{world:03d}.json")) as f:
            ok.update(json.load(f))
    return ok


class CachedClips(Dataset):
    def __init__(self, clips, cache_dir, sp, train):
        self.clips, self.cache_dir, self.sp, self.train = clips, cache_dir, sp, train

    def __len__(self):
        return len(self.clips)

    def __getitem__(self, i):
        c = self.clips[i]
        v = np.load(os.path.join(self.cache_dir, c["id"] + ".npy"))
        o = np.random.randint(0, 9, 2) if self.train else (4, 4)
        v = (v[:, o[0]:o[0] + 88, o[1]:o[1] + 88].astype(np.float32) / 255.0 - 0.421) / 0.165
        wav, _ = torchaudio.load(os.path.join(self.cache_dir, c["id"] + ".wav"))
        fb = torchaudio.compliance.kaldi.fbank(wav * 32768, num_mel_bins=80)
        need = 4 * len(v)
        fb = F.pad(fb, (0, 0, 0, max(0, need - len(fb))))[:need]
        fb = (fb - fb.mean(0)) / (fb.std(0) + 1e-5)
        return torch.from_numpy(v), fb, torch.tensor(self.sp.encode(c["text"].lower())) + 1, c["text"].lower()


def collate(b):
    v, a, y, t = zip(*b)
    ps = nn.utils.rnn.pad_sequence
    return ps(v, True), ps(a, True), torch.tensor([len(x) for x in v]), ps(y, True), torch.tensor([len(x) for x in y]), t


class AVSR(nn.Module):
    def __init__(self, vocab, d=384):
        super().__init__()
        self.v = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3)), nn.BatchNorm3d(64), nn.SiLU(),
                               nn.Conv3d(64, 128, (3, 3, 3), (1, 2, 2), 1), nn.BatchNorm3d(128), nn.SiLU(),
                               nn.Conv3d(128, 256, (3, 3, 3), (1, 2, 2), 1), nn.BatchNorm3d(256), nn.SiLU())
        self.a = nn.Sequential(nn.Conv1d(80, 256, 3, 2, 1), nn.SiLU(), nn.Conv1d(256, 256, 3, 2, 1), nn.SiLU())
        self.proj = nn.Linear(512, d)
        self.pos = nn.Parameter(torch.zeros(1, 2000, d))
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 6, 1536, 0.1, batch_first=True), 12)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 6, 1536, 0.1, batch_first=True), 4)
        self.emb = nn.Embedding(vocab, d)
        self.ctc_out, self.att_out = nn.Linear(d, vocab), nn.Linear(d, vocab)
        self.eos = vocab - 1

    def encode(self, v, a, lens):
        t = v.size(1)
        hv = self.v(v.unsqueeze(1)).mean((3, 4)).transpose(1, 2)
        ha = self.a(a.transpose(1, 2)).transpose(1, 2)[:, :t]
        x = self.proj(torch.cat([hv, ha], -1)) + self.pos[:, :t]
        mask = torch.arange(t, device=x.device)[None] >= lens[:, None]
        return self.enc(x, src_key_padding_mask=mask), mask

    def forward(self, v, a, lens, y, ylens, w=0.1):
        mem, mask = self.encode(v, a, lens)
        l_ctc = F.ctc_loss(self.ctc_out(mem).float().log_softmax(-1).transpose(0, 1), y, lens, ylens, zero_infinity=True)
        y_in = F.pad(y, (1, 0), value=self.eos)
        y_out = F.pad(y, (0, 1))
        y_out[torch.arange(len(y)), ylens] = self.eos
        y_out = y_out.masked_fill(torch.arange(y_out.size(1), device=y.device)[None] > ylens[:, None], -100)
        L = y_in.size(1)
        h = self.dec(self.emb(y_in) + self.pos[:, :L], mem, memory_key_padding_mask=mask,
                     tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=y.device))
        l_att = F.cross_entropy(self.att_out(h).float().transpose(1, 2), y_out, ignore_index=-100, label_smoothing=0.1)
        return w * l_ctc + (1 - w) * l_att


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clips", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--spm", default="/shared/corpus/spm_unigram1000.model")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # preprocessing runs before the first barrier and can take a few hours on a new corpus
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=4))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    clips = read_clips(args.clips)
    os.makedirs(args.cache, exist_ok=True)
    cache_shard(clips, args.cache, rank, world, dev)
    dist.barrier()
    ok = load_index(args.cache, world)
    train_clips = [c for c in clips if c["split"] == "train" and c["id"] in ok]
    valid_clips = [c for c in clips if c["split"] == "valid" and c["id"] in ok]

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    V = sp.get_piece_size() + 2
    train_ds = CachedClips(train_clips, args.cache, sp, True)
    valid_ds = CachedClips(valid_clips[rank::world], args.cache, sp, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, collate_fn=collate, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, args.bs, num_workers=4, collate_fn=collate)

    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(AVSR(V)).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.03)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=total, pct_start=0.1)

    ckpt_path = os.path.join(args.exp, "checkpoint.pt")
    start_epoch, best = 0, math.inf
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
        if rank == 0:
            print(f"resumed at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (v, a, lens, y, ylens, _) in enumerate(train_dl):
            v, a, lens, y, ylens = (x.to(dev, non_blocking=True) for x in (v, a, lens, y, ylens))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(v, a, lens, y, ylens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.3f} {time.time() - t0:.0f}s", flush=True)

        net = model.module
        net.eval()
        pairs = []
        with torch.no_grad():
            for v, a, lens, _, _, texts in valid_dl:
                mem, _ = net.encode(v.to(dev), a.to(dev), lens.to(dev))
                for row, n, ref in zip(net.ctc_out(mem).argmax(-1).tolist(), lens.tolist(), texts):
                    toks, prev = [], None
                    for t in row[:n]:
                        if t != prev and 0 < t < V - 1:
                            toks.append(t - 1)
                        prev = t
                    pairs.append((ref, sp.decode(toks)))
        net.train()
        everything = [None] * world
        dist.all_gather_object(everything, pairs)
        if rank == 0:
            pairs = [p for part in everything for p in part]
            errs = sum(editdistance.eval(h.split(), r.split()) for r, h in pairs)
            wer = errs / max(1, sum(len(r.split()) for r, _ in pairs))
            best = min(best, wer)
            print(f"epoch {epoch} valid WER {100 * wer:.2f}% (best {100 * best:.2f}%)", flush=True)
            os.makedirs(args.exp, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if wer == best:
                torch.save({"model": net.state_dict(), "epoch": epoch, "wer": wer}, os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
