"""BiLSTM-CTC phone recogniser on TIMIT (39-phone folding), with cached fbank+delta features.

torchrun --nproc_per_node=4 14_timit_blstm_ctc_cache.py --timit /data/TIMIT --cache_dir cache/timit
"""
import argparse
import glob
import os
import random

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PHONES_61_TO_39 = {
    "aa": "aa", "ao": "aa", "ae": "ae", "ah": "ah", "ax": "ah", "ax-h": "ah", "aw": "aw", "ay": "ay", "b": "b",
    "ch": "ch", "d": "d", "dh": "dh", "dx": "dx", "eh": "eh", "el": "l", "l": "l", "em": "m", "m": "m",
    "en": "n", "n": "n", "nx": "n", "eng": "ng", "ng": "ng", "er": "er", "axr": "er", "ey": "ey", "f": "f",
    "g": "g", "hh": "hh", "hv": "hh", "ih": "ih", "ix": "ih", "iy": "iy", "jh": "jh", "k": "k", "ow": "ow",
    "oy": "oy", "p": "p", "r": "r", "s": "s", "sh": "sh", "zh": "sh", "t": "t", "th": "th", "uh": "uh",
    "uw": "uw", "ux": "uw", "v": "v", "w": "w", "y": "y", "z": "z",
    "pau": "sil", "epi": "sil", "h#": "sil", "bcl": "sil", "dcl": "sil", "gcl": "sil", "kcl": "sil",
    "pcl": "sil", "tcl": "sil", "q": None,
}
PHONES_39 = sorted({p for p in PHONES_61_TO_39.values() if p is not None})
PHONE2ID = {p: i + 1 for i, p in enumerate(PHONES_39)}  # 0 = blank
CORE_TEST_SPK = {"mdab0", "mwbt0", "felc0", "mtas1", "mwew0", "fpas0", "mjmp0", "mlnt0", "fpkt0", "mlll0",
                 "mtls0", "fjlm0", "mbpm0", "mklt0", "fnlp0", "mcmj0", "mjdh0", "fmgd0", "mgrt0", "mnjm0",
                 "fdhc0", "mjln0", "mpam0", "fmld0"}


def list_utts(timit_root, split):
    wavs = sorted(glob.glob(os.path.join(timit_root, split.upper(), "*", "*", "*.WAV")))
    wavs = [w for w in wavs if not os.path.basename(w).upper().startswith("SA")]
    if split == "test":
        wavs = [w for w in wavs if os.path.basename(os.path.dirname(w)).lower() in CORE_TEST_SPK]
    return wavs


def extract(wav_path):
    wav, sr = torchaudio.load(wav_path)
    fb = torchaudio.compliance.kaldi.fbank(wav * 32768, num_mel_bins=40, sample_frequency=sr, dither=0.0)
    d1 = torchaudio.functional.compute_deltas(fb.T).T
    d2 = torchaudio.functional.compute_deltas(d1.T).T
    feats = torch.cat([fb, d1, d2], dim=1)
    phn = []
    with open(os.path.splitext(wav_path)[0] + ".PHN") as f:
        for line in f:
            p = PHONES_61_TO_39[line.split()[2]]
            if p is not None and (not phn or phn[-1] != PHONE2ID[p] or p != "sil"):
                phn.append(PHONE2ID[p])
    return feats.numpy().astype(np.float32), np.array(phn, dtype=np.int64)


def load_or_build_cache(timit_root, split, cache_dir):
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"{split}_fbank40_dd.npz")
    if os.path.isfile(path):
        blob = np.load(path, allow_pickle=True)
        return list(blob["feats"]), list(blob["labels"])
    feats, labels = [], []
    for w in list_utts(timit_root, split):
        f, l = extract(w)
        feats.append(f)
        labels.append(l)
    fo, lo = np.empty(len(feats), dtype=object), np.empty(len(labels), dtype=object)
    for i, (f, l) in enumerate(zip(feats, labels)):
        fo[i], lo[i] = f, l
    np.savez(path, feats=fo, labels=lo)
    return feats, labels


class CachedDataset(Dataset):
    def __init__(self, feats, labels, mean=None, std=None):
        self.feats, self.labels = feats, labels
        if mean is None:
            allf = np.concatenate(feats)
            mean, std = allf.mean(0), allf.std(0) + 1e-5
        self.mean, self.std = mean, std

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        x = (self.feats[i] - self.mean) / self.std
        return torch.from_numpy(x), torch.from_numpy(self.labels[i])


def collate(batch):
    xs, ys = zip(*batch)
    xl = torch.tensor([x.size(0) for x in xs])
    yl = torch.tensor([y.size(0) for y in ys])
    return nn.utils.rnn.pad_sequence(xs, batch_first=True), xl, torch.cat(ys), yl


class BLSTMCTC(nn.Module):
    def __init__(self, idim=120, hidden=320, layers=4, n_out=len(PHONES_39) + 1, dropout=0.2):
        super().__init__()
        self.lstm = nn.LSTM(idim, hidden, layers, batch_first=True, bidirectional=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(2 * hidden, n_out)

    def forward(self, x, xl):
        packed = nn.utils.rnn.pack_padded_sequence(x, xl.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.lstm(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True)
        return self.out(self.drop(h)).log_softmax(-1)


@torch.no_grad()
def per(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, xl, y, yl in loader:
        lp = model(x.to(device), xl)
        pred = lp.argmax(-1).cpu()
        refs = torch.split(y, yl.tolist())
        for p, n, r in zip(pred, xl, refs):
            hyp = [int(t) for t in torch.unique_consecutive(p[:n]) if t != 0]
            s[0] += editdistance.eval(hyp, r.tolist())
            s[1] += len(r)
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timit", required=True)
    ap.add_argument("--cache_dir", default="cache/timit")
    ap.add_argument("--out_dir", default="exp/timit_blstm")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(0)

    tr_f, tr_l = load_or_build_cache(args.timit, "train", args.cache_dir)
    te_f, te_l = load_or_build_cache(args.timit, "test", args.cache_dir)
    train_ds = CachedDataset(tr_f, tr_l)
    test_ds = CachedDataset(te_f, te_l, train_ds.mean, train_ds.std)

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=2)
    test_loader = DataLoader(test_ds, args.batch_size, sampler=DistributedSampler(test_ds, shuffle=False),
                             collate_fn=collate, num_workers=2)

    model = DDP(BLSTMCTC().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=2)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best = 1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tot = torch.zeros(2, device=device)
        for x, xl, y, yl in train_loader:
            x, y = x.to(device), y.to(device)
            lp = model(x, xl)
            loss = ctc(lp.transpose(0, 1), y, xl.to(device), yl.to(device))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 400)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        err = per(model, test_loader, device)
        plateau.step(err)
        if rank == 0:
            print(f"epoch {epoch:02d} train_ctc {tot[0] / tot[1]:.3f} core-test PER {err * 100:.2f}% "
                  f"lr {opt.param_groups[0]['lr']:.1e}", flush=True)
            if err < best:
                best = err
                torch.save({"model": model.module.state_dict(), "mean": train_ds.mean, "std": train_ds.std,
                            "epoch": epoch}, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
