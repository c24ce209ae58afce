"""CTC Conformer on LibriSpeech train-clean-100, one process per GPU.

    python 18_ctc_conformer_spawn.py --root /data/librispeech --out /shared/asr/conformer_ctc --nproc 4

Each child fills in its rank variables and initialises the process group
from the environment, the same way the worker would under torchrun.
"""
import argparse
import os
import string
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

VOCAB = ["<blank>", " ", "'"] + list(string.ascii_lowercase)
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


class Featurizer:
    def __init__(self):
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)

    def __call__(self, batch):
        feats, flens, targets, tlens, texts = [], [], [], [], []
        for wav, sr, text, *_ in batch:
            f = (self.mel(wav[0]) + 1e-6).log().t()
            f = (f - f.mean(0)) / (f.std(0) + 1e-5)
            t = torch.tensor([CHAR2ID[c] for c in text.lower() if c in CHAR2ID])
            feats.append(f)
            flens.append(f.size(0))
            targets.append(t)
            tlens.append(t.numel())
            texts.append(text.lower())
        return (nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor(flens),
                torch.cat(targets), torch.tensor(tlens), texts)


class ConformerCTC(nn.Module):
    def __init__(self, d=256, layers=12):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.proj = nn.Linear(d * 19, d)
        self.enc = torchaudio.models.Conformer(input_dim=d, num_heads=4, ffn_dim=4 * d, num_layers=layers,
                                               depthwise_conv_kernel_size=31, dropout=0.1)
        self.out = nn.Linear(d, len(VOCAB))

    def forward(self, x, lens):
        x = self.sub(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        lens = lens.clamp(max=t)
        x, lens = self.enc(x, lens)
        return self.out(x).log_softmax(-1), lens


def greedy_decode(logp, lens):
    out = []
    for seq, n in zip(logp.argmax(-1).tolist(), lens.tolist()):
        prev, chars = 0, []
        for s in seq[:n]:
            if s != prev and s != 0:
                chars.append(VOCAB[s])
            prev = s
        out.append("".join(chars))
    return out


@torch.no_grad()
def word_error_rate(model, dl, device):
    model.eval()
    errs = torch.zeros(2, device=device)
    for x, xl, _, _, texts in dl:
        logp, ol = model(x.to(device), xl.to(device))
        for hyp, ref in zip(greedy_decode(logp, ol), texts):
            errs[0] += torchaudio.functional.edit_distance(ref.split(), hyp.split())
            errs[1] += len(ref.split())
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1]).item()


def worker(local_rank, nproc, args):
    os.environ["RANK"] = str(local_rank)
    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["WORLD_SIZE"] = str(nproc)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = torchaudio.datasets.LIBRISPEECH(args.root, url="train-clean-100")
    dev_ds = torchaudio.datasets.LIBRISPEECH(args.root, url="dev-clean")
    feat = Featurizer()
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=feat,
                    num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, range(rank, len(dev_ds), world)),
                        batch_size=16, collate_fn=feat, num_workers=4)

    model = DDP(ConformerCTC().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3)
    d_model, warmup = 256, args.warmup

    def noam(step):
        step = max(step, 1)
        return min(step ** -0.5, step * warmup ** -1.5) * warmup ** 0.5

    sched = torch.optim.lr_scheduler.LambdaLR(opt, noam)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    ckpt = os.path.join(args.out, "last.pt")
    start = 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location=device)
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start = st["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, xl, y, yl, _) in enumerate(dl):
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp, ol = model(x, xl)
            loss = ctc(logp.float().transpose(0, 1), y, ol, yl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(dl)} ctc {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)
        wer = word_error_rate(model, dev_dl, device)
        if rank == 0:
            print(f"epoch {epoch} dev-clean WER {wer * 100:.2f}% ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "wer": wer}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--peak-lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10000)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
