"""DeepSpeech2-style (2D conv + BiGRU + CTC) on a WeNet-format data.list.

data.list lines: {"key": "...", "wav": "/path.wav", "txt": "..."}
torchrun --nproc_per_node=8 10_ds2_global_cmvn.py --train_data data/train/data.list \
    --cv_data data/dev/data.list --symbol_table data/dict/units.txt --model_dir exp/ds2
"""
import argparse
import json
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import torchaudio.compliance.kaldi as kaldi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def read_list(path):
    with open(path, encoding="utf8") as f:
        return [json.loads(l) for l in f if l.strip()]


def read_symbol_table(path):
    table = {}
    with open(path, encoding="utf8") as f:
        for line in f:
            tok, idx = line.split()
            table[tok] = int(idx)
    return table


def fbank(wav_path):
    wav, sr = torchaudio.load(wav_path)
    wav = wav * (1 << 15)
    return kaldi.fbank(wav, num_mel_bins=80, frame_length=25, frame_shift=10, dither=0.0,
                       energy_floor=0.0, sample_frequency=sr)


def compute_cmvn(items):
    mean_stat = np.zeros(80)
    var_stat = np.zeros(80)
    frame_num = 0
    for it in items:
        f = fbank(it["wav"]).numpy()
        mean_stat += f.sum(0)
        var_stat += np.square(f).sum(0)
        frame_num += f.shape[0]
    return {"mean_stat": mean_stat.tolist(), "var_stat": var_stat.tolist(), "frame_num": frame_num}


def load_cmvn(path):
    with open(path) as f:
        s = json.load(f)
    mean = np.array(s["mean_stat"]) / s["frame_num"]
    var = np.array(s["var_stat"]) / s["frame_num"] - mean * mean
    istd = 1.0 / np.sqrt(np.maximum(var, 1e-20))
    return torch.tensor(mean, dtype=torch.float32), torch.tensor(istd, dtype=torch.float32)


class AsrDataset(Dataset):
    def __init__(self, items, symbols, mean, istd):
        self.items = items
        self.symbols = symbols
        self.unk = symbols["<unk>"]
        self.mean, self.istd = mean, istd

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        feats = (fbank(it["wav"]) - self.mean) * self.istd
        label = torch.tensor([self.symbols.get(ch, self.unk) for ch in it["txt"].replace(" ", "▁")])
        return feats, label


def collate(batch):
    feats, labels = zip(*batch)
    return (nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor([f.size(0) for f in feats]),
            nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-1),
            torch.tensor([l.size(0) for l in labels]))


class DeepSpeech2(nn.Module):
    def __init__(self, vocab_size, rnn_hidden=768, rnn_layers=5):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, (41, 11), stride=(2, 2), padding=(20, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20),
            nn.Conv2d(32, 32, (21, 11), stride=(2, 1), padding=(10, 5)), nn.BatchNorm2d(32), nn.Hardtanh(0, 20),
        )
        self.rnn = nn.GRU(32 * 20, rnn_hidden, num_layers=rnn_layers, bidirectional=True, batch_first=True,
                          dropout=0.1)
        self.fc = nn.Sequential(nn.LayerNorm(2 * rnn_hidden), nn.Linear(2 * rnn_hidden, vocab_size))

    def forward(self, x, lens):
        x = self.conv(x.transpose(1, 2).unsqueeze(1))  # (B, 32, F', T')
        b, c, f, t = x.shape
        x = x.permute(0, 3, 1, 2).reshape(b, t, c * f)
        lens = (lens + 2 * 5 - 11) // 2 + 1
        x = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        x, _ = self.rnn(x)
        x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True, total_length=t)
        return self.fc(x).log_softmax(-1), lens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_data", required=True)
    ap.add_argument("--cv_data", required=True)
    ap.add_argument("--symbol_table", required=True)
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--cmvn_utts", type=int, default=20000)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--max_epoch", type=int, default=50)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    os.makedirs(args.model_dir, exist_ok=True)

    symbols = read_symbol_table(args.symbol_table)
    train_items = read_list(args.train_data)
    cv_items = read_list(args.cv_data)

    cmvn_file = os.path.join(args.model_dir, "global_cmvn")
    if not os.path.exists(cmvn_file):
        logging.info("computing global cmvn on %d utterances", args.cmvn_utts)
        stats = compute_cmvn(train_items[: args.cmvn_utts])
        with open(cmvn_file, "w") as f:
            json.dump(stats, f)
    mean, istd = load_cmvn(cmvn_file)

    train_set = AsrDataset(train_items, symbols, mean, istd)
    cv_set = AsrDataset(cv_items, symbols, mean, istd)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    cv_sampler = DistributedSampler(cv_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=8, pin_memory=True, prefetch_factor=4)
    cv_loader = DataLoader(cv_set, batch_size=args.batch_size, sampler=cv_sampler, collate_fn=collate,
                           num_workers=4)

    model = DeepSpeech2(len(symbols))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.1,
                                                    total_steps=args.max_epoch * len(train_loader))
    ctc = nn.CTCLoss(blank=symbols["<blank>"], reduction="mean", zero_infinity=True)

    best_cv = float("inf")
    for epoch in range(args.max_epoch):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (x, xl, y, yl) in enumerate(train_loader):
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            log_probs, out_lens = model(x, xl)
            loss = ctc(log_probs.transpose(0, 1), y.clamp(min=0), out_lens, yl)
            optimizer.zero_grad()
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 400.0)
            optimizer.step()
            scheduler.step()
            if i % 100 == 0:
                logging.info("epoch %d batch %d loss %.4f grad_norm %.2f lr %.3e",
                             epoch, i, loss.item(), grad_norm.item(), scheduler.get_last_lr()[0])

        # cross-validation loss, averaged over all ranks (equal number of batches via drop_last)
        model.eval()
        cv = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, xl, y, yl in cv_loader:
                x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
                log_probs, out_lens = model(x, xl)
                cv[0] += ctc(log_probs.transpose(0, 1), y.clamp(min=0), out_lens, yl) * x.size(0)
                cv[1] += x.size(0)
        dist.all_reduce(cv)
        cv_loss = (cv[0] / cv[1]).item()
        logging.info("epoch %d cv loss %.4f", epoch, cv_loss)

        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.model_dir, f"{epoch}.pt"))
            if cv_loss < best_cv:
                torch.save(model.module.state_dict(), os.path.join(args.model_dir, "best.pt"))
        best_cv = min(best_cv, cv_loss)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
