"""Conformer-CTC on AISHELL-1 (Mandarin characters, CER).

Fbank features are extracted once and cached next to the data (feats_cache/<split>.pt),
later runs load the cache directly.

    torchrun --nproc_per_node=8 17_conformer_ctc_aishell.py --data_dir /data/aishell1 \
        --units /data/aishell1/units.txt --exp exp/aishell_conformer_ctc
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import torchaudio.compliance.kaldi as kaldi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import editdistance


def args_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--units", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=25000)
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--num_layers", type=int, default=12)
    ap.add_argument("--average_last", type=int, default=10)
    return ap.parse_args()


def read_kaldi_dir(d):
    wavs, texts = {}, {}
    with open(os.path.join(d, "wav.scp")) as f:
        for line in f:
            k, v = line.strip().split(maxsplit=1)
            wavs[k] = v
    with open(os.path.join(d, "text")) as f:
        for line in f:
            parts = line.strip().split(maxsplit=1)
            if len(parts) == 2:
                texts[parts[0]] = parts[1].replace(" ", "")
    keys = sorted(k for k in wavs if k in texts)
    return [(k, wavs[k], texts[k]) for k in keys]


def extract(entries):
    feats = {}
    for utt, path, _ in entries:
        wav, sr = torchaudio.load(path)
        fb = kaldi.fbank(wav * (1 << 15), num_mel_bins=80, frame_length=25, frame_shift=10,
                         dither=0.0, sample_frequency=sr)
        feats[utt] = fb.half()
    return feats


def load_features(data_dir, split):
    entries = read_kaldi_dir(os.path.join(data_dir, split))
    cache_dir = os.path.join(data_dir, "feats_cache")
    cache = os.path.join(cache_dir, f"{split}.pt")
    if os.path.isfile(cache):
        feats = torch.load(cache, map_location="cpu", mmap=True)
    else:
        os.makedirs(cache_dir, exist_ok=True)
        feats = extract(entries)
        torch.save(feats, cache)
    return entries, feats


class AishellSet(Dataset):
    def __init__(self, entries, feats, unit2id, cmvn, specaug=False):
        self.entries, self.feats, self.unit2id = entries, feats, unit2id
        self.mean, self.istd = cmvn
        self.aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(10), torchaudio.transforms.FrequencyMasking(10),
                                 torchaudio.transforms.TimeMasking(50), torchaudio.transforms.TimeMasking(50)) \
            if specaug else None

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        utt, _, text = self.entries[i]
        x = (self.feats[utt].float() - self.mean) * self.istd
        if self.aug is not None:
            x = self.aug(x.t().unsqueeze(0)).squeeze(0).t()
        y = torch.tensor([self.unit2id.get(c, self.unit2id["<unk>"]) for c in text])
        return x, y, text


def pad_batch(batch):
    xs, ys, texts = zip(*batch)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([len(x) for x in xs]),
            nn.utils.rnn.pad_sequence(ys, batch_first=True), torch.tensor([len(y) for y in ys]), texts)


class Net(nn.Module):
    def __init__(self, n_units, d_model, num_layers):
        super().__init__()
        self.embed = nn.Sequential(nn.Conv2d(1, d_model, 3, 2), nn.ReLU(), nn.Conv2d(d_model, d_model, 3, 2),
                                   nn.ReLU())
        self.proj = nn.Linear(d_model * 19, d_model)
        self.encoder = torchaudio.models.Conformer(d_model, 4, 2048, num_layers, 15, dropout=0.1,
                                                   use_group_norm=True)
        self.ctc = nn.Linear(d_model, n_units)

    def forward(self, x, lens):
        x = self.embed(x.unsqueeze(1))
        x = self.proj(x.transpose(1, 2).flatten(2))
        lens = ((lens - 1) // 2 - 1) // 2
        x, lens = self.encoder(x, lens)
        return self.ctc(x), lens


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(777)

    with open(args.units, encoding="utf-8") as f:
        units = [line.split()[0] for line in f if line.strip()]
    unit2id = {u: i for i, u in enumerate(units)}  # units.txt starts with <blank> <unk>

    train_entries, train_feats = load_features(args.data_dir, "train")
    dev_entries, dev_feats = load_features(args.data_dir, "dev")
    stacked = torch.cat([train_feats[k].float() for k, _, _ in train_entries[:5000]])
    cmvn = (stacked.mean(0), 1.0 / (stacked.std(0) + 1e-5))

    train_set = AishellSet(train_entries, train_feats, unit2id, cmvn, specaug=True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=pad_batch,
                          num_workers=4, pin_memory=True, drop_last=True)
    dev_set = AishellSet(dev_entries[rank::world], dev_feats, unit2id, cmvn)
    dev_dl = DataLoader(dev_set, batch_size=64, collate_fn=pad_batch, num_workers=2)

    model = DDP(Net(len(units), args.d_model, args.num_layers).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, (args.warmup / (s + 1)) ** 0.5))
    ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)

    writer = SummaryWriter(os.path.join(args.exp, "tensorboard")) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, xl, y, yl, _ in train_dl:
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, ol = model(x, xl)
            loss = ctc(logits.float().log_softmax(-1).transpose(0, 1), y, ol, yl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar("loss/ctc", loss.item(), step)
                writer.add_scalar("lr", sched.get_last_lr()[0], step)

        model.eval()
        err = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, xl, _, _, texts in dev_dl:
                logits, ol = model.module(x.to(device), xl.to(device))
                pred = logits.argmax(-1)
                for k, ref in enumerate(texts):
                    ids = torch.unique_consecutive(pred[k, : ol[k]]).tolist()
                    hyp = "".join(units[t] for t in ids if t != 0)
                    err[0] += editdistance.eval(list(ref), list(hyp))
                    err[1] += len(ref)
        dist.all_reduce(err)
        if rank == 0:
            cer = (err[0] / err[1]).item()
            writer.add_scalar("dev/cer", cer, step)
            print(f"epoch {epoch} | {time.time() - t0:.0f}s | dev CER {100 * cer:.2f}%", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.exp, f"{epoch}.pt"))
        dist.barrier()

    if rank == 0:
        # average the last N epoch checkpoints for the final model
        avg = None
        for e in range(args.epochs - args.average_last, args.epochs):
            sd = torch.load(os.path.join(args.exp, f"{e}.pt"), map_location="cpu")
            if avg is None:
                avg = {k: v.clone().double() for k, v in sd.items()}
            else:
                for k in avg:
                    avg[k] += sd[k].double()
        avg = {k: (v / args.average_last).to(sd[k].dtype) for k, v in avg.items()}
        torch.save(avg, os.path.join(args.exp, f"avg_{args.average_last}.pt"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
