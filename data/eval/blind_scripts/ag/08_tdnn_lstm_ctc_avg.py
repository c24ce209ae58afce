#!/usr/bin/env python3
# TDNN-LSTM CTC (BPE 500) on LibriSpeech, icefall-style recipe without k2.
# Launched by Slurm directly, one task per GPU:
#   srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8 \
#        python 08_tdnn_lstm_ctc_avg.py --exp-dir /shared/exp/tdnn_lstm_ctc
import argparse
import logging
import os
import subprocess
from collections import OrderedDict
from pathlib import Path

import kaldiio
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

import editdistance


def init_slurm(port):
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    node_list = os.environ["SLURM_STEP_NODELIST"]
    master = subprocess.check_output(f"scontrol show hostnames {node_list} | head -n1", shell=True).decode().strip()
    os.environ["MASTER_ADDR"] = master
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(local_rank)
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return rank, world_size, local_rank


class FeatsDataset(Dataset):
    def __init__(self, scp, text, sp):
        self.utts = []
        with open(scp) as f:
            for line in f:
                uid, ark = line.strip().split(maxsplit=1)
                self.utts.append((uid, ark))
        self.text = dict(l.strip().split(maxsplit=1) for l in open(text))
        self.sp = sp

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, i):
        uid, ark = self.utts[i]
        feats = torch.from_numpy(kaldiio.load_mat(ark)).float()
        txt = self.text[uid]
        return uid, feats, torch.tensor(self.sp.encode(txt)), txt


def collate(batch):
    uids, feats, toks, txts = zip(*batch)
    return (list(uids), nn.utils.rnn.pad_sequence(feats, batch_first=True),
            torch.tensor([f.size(0) for f in feats]), torch.cat(toks),
            torch.tensor([t.size(0) for t in toks]), list(txts))


class TdnnLstm(nn.Module):
    def __init__(self, num_features, num_classes, subsampling=3, hidden=512, lstm_layers=4):
        super().__init__()
        self.subsampling = subsampling
        self.tdnn = nn.Sequential(
            nn.Conv1d(num_features, hidden, 3, padding=1), nn.ReLU(),
            nn.Conv1d(hidden, hidden, 3, padding=1), nn.ReLU(),
            nn.Conv1d(hidden, hidden, 3, stride=subsampling, padding=1), nn.ReLU(),
        )
        self.lstms = nn.ModuleList([nn.LSTM(hidden, hidden) for _ in range(lstm_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(lstm_layers)])
        self.dropout = nn.Dropout(0.2)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x, lens):
        x = self.tdnn(x.transpose(1, 2)).permute(2, 0, 1)  # (T, N, C)
        for lstm, norm in zip(self.lstms, self.norms):
            y, _ = lstm(x)
            x = self.dropout(norm(x + y))
        out_lens = (lens + 2 - 3) // self.subsampling + 1
        return self.out(x).log_softmax(-1), out_lens


def average_checkpoints(paths):
    avg = None
    for p in paths:
        sd = torch.load(p, map_location="cpu")["model"]
        if avg is None:
            avg = OrderedDict((k, v.clone().double()) for k, v in sd.items())
        else:
            for k in avg:
                avg[k] += sd[k].double()
    for k in avg:
        avg[k] = (avg[k] / len(paths)).to(sd[k].dtype)
    return avg


@torch.no_grad()
def decode_dataset(model, loader, sp, device):
    model.eval()
    results = []
    for uids, feats, lens, _, _, txts in loader:
        log_probs, out_lens = model(feats.to(device), lens.to(device))
        best = log_probs.argmax(-1).transpose(0, 1).cpu()
        for uid, seq, n, ref in zip(uids, best, out_lens.cpu(), txts):
            ids = [int(t) for t in torch.unique_consecutive(seq[:n]) if t != 0]
            results.append((uid, ref, sp.decode(ids)))
    model.train()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="data/fbank")
    ap.add_argument("--bpe-model", default="data/lang_bpe_500/bpe.model")
    ap.add_argument("--exp-dir", required=True, help="must be on storage shared by all nodes")
    ap.add_argument("--num-epochs", type=int, default=20)
    ap.add_argument("--avg", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--master-port", type=int, default=12354)
    args = ap.parse_args()

    rank, world_size, local_rank = init_slurm(args.master_port)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format=f"%(asctime)s [{rank}] %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    exp = Path(args.exp_dir)
    if rank == 0:
        exp.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    sp = spm.SentencePieceProcessor(model_file=args.bpe_model)
    train = FeatsDataset(f"{args.data_dir}/train_960/feats.scp", f"{args.data_dir}/train_960/text", sp)
    test = FeatsDataset(f"{args.data_dir}/test_clean/feats.scp", f"{args.data_dir}/test_clean/text", sp)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True)
    # unequal shard sizes are fine here: decoding runs on the bare module, no collectives inside
    test_dl = DataLoader(Subset(test, range(rank, len(test), world_size)), batch_size=32,
                         collate_fn=collate, num_workers=2)

    model = TdnnLstm(80, sp.get_piece_size()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ctc = nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)

    for epoch in range(1, args.num_epochs + 1):
        sampler.set_epoch(epoch)
        tot = torch.zeros(2, device=device)
        for step, (_, feats, lens, toks, tok_lens, _) in enumerate(train_dl):
            log_probs, out_lens = model(feats.to(device), lens.to(device))
            loss = ctc(log_probs, toks.to(device), out_lens, tok_lens.to(device))
            opt.zero_grad()
            (loss / feats.size(0)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            tot[0] += loss.detach()
            tot[1] += lens.sum().item()
            if step % 50 == 0:
                logging.info("epoch %d batch %d loss/frame %.4f", epoch, step, (loss / lens.sum()).item())
        sched.step()
        dist.all_reduce(tot)
        logging.info("epoch %d train loss/frame %.4f", epoch, (tot[0] / tot[1]).item())
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                       exp / f"epoch-{epoch}.pt")
        dist.barrier()

    # average the last N epochs on rank 0, everyone else waits, then all ranks decode with it
    avg_path = exp / f"avg-{args.avg}.pt"
    if rank == 0:
        start = max(1, args.num_epochs - args.avg + 1)
        paths = [exp / f"epoch-{e}.pt" for e in range(start, args.num_epochs + 1)]
        logging.info("averaging %s", [p.name for p in paths])
        torch.save({"model": average_checkpoints(paths)}, avg_path)
    dist.barrier()
    model.module.load_state_dict(torch.load(avg_path, map_location="cpu")["model"])

    results = decode_dataset(model.module, test_dl, sp, device)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        errs = words = 0
        with open(exp / f"recogs-test_clean-avg{args.avg}.txt", "w") as f:
            for uid, ref, hyp in sorted(r for part in gathered for r in part):
                errs += editdistance.eval(ref.split(), hyp.split())
                words += len(ref.split())
                f.write(f"{uid}\tref={ref}\thyp={hyp}\n")
        logging.info("test-clean WER (avg %d): %.2f%%", args.avg, 100.0 * errs / words)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
