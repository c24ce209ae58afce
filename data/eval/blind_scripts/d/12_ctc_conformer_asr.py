"""
Character-level CTC ASR with a torchaudio Conformer encoder on LibriSpeech (already downloaded).

    torchrun --nproc_per_node=4 12_ctc_conformer_asr.py --root /data/librispeech --epochs 80
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


def text_to_ids(text):
    return torch.tensor([CHAR2ID[c] for c in text.lower() if c in CHAR2ID], dtype=torch.long)


class Featurizer:
    def __init__(self, train):
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)
        self.aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(27),
                                 torchaudio.transforms.TimeMasking(40, p=0.05)) if train else None

    def __call__(self, wav):
        x = (self.mel(wav) + 1e-6).log()          # 1 x 80 x T
        x = (x - x.mean()) / (x.std() + 1e-5)
        if self.aug is not None:
            x = self.aug(x)
        return x.squeeze(0).transpose(0, 1)      # T x 80


def make_collate(featurizer):
    def collate(batch):
        feats, labels = [], []
        for wav, sr, text, *_ in batch:
            feats.append(featurizer(wav))
            labels.append(text_to_ids(text))
        feat_lens = torch.tensor([f.size(0) for f in feats])
        label_lens = torch.tensor([l.size(0) for l in labels])
        return pad_sequence(feats, batch_first=True), feat_lens, pad_sequence(labels, batch_first=True), label_lens
    return collate


class ConformerCTC(nn.Module):
    def __init__(self, n_mels=80, d_model=256, layers=12, heads=4, ffn=1024, vocab=len(VOCAB)):
        super().__init__()
        # 4x time subsampling
        self.subsample = nn.Sequential(
            nn.Conv2d(1, d_model, 3, stride=2), nn.ReLU(),
            nn.Conv2d(d_model, d_model, 3, stride=2), nn.ReLU())
        self.proj = nn.Linear(d_model * (((n_mels - 1) // 2 - 1) // 2), d_model)
        self.encoder = torchaudio.models.Conformer(input_dim=d_model, num_heads=heads, ffn_dim=ffn,
                                                   num_layers=layers, depthwise_conv_kernel_size=31,
                                                   dropout=0.1, use_group_norm=True)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x, lens):
        x = self.subsample(x.unsqueeze(1))                 # B C T' F'
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        lens = lens.clamp(max=t)
        x, lens = self.encoder(x, lens)
        return self.head(x).log_softmax(-1), lens


def greedy_decode(log_probs, lens):
    out = []
    for lp, n in zip(log_probs, lens):
        ids = lp[:n].argmax(-1).tolist()
        prev, chars = -1, []
        for i in ids:
            if i != prev and i != 0:
                chars.append(VOCAB[i])
            prev = i
        out.append("".join(chars).strip())
    return out


def edit_distance(a, b):
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            cur = d[j]
            d[j] = min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
            prev = cur
    return d[len(b)]


@torch.no_grad()
def evaluate_wer(model, loader, device):
    model.eval()
    errors, words = 0, 0
    for feats, feat_lens, labels, label_lens in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            log_probs, out_lens = model(feats.to(device), feat_lens.to(device))
        hyps = greedy_decode(log_probs.float().cpu(), out_lens.cpu())
        for hyp, lab, n in zip(hyps, labels, label_lens):
            ref = "".join(VOCAB[i] for i in lab[:n].tolist()).split()
            errors += edit_distance(hyp.split(), ref)
            words += len(ref)
    stats = torch.tensor([errors, words], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[1]).item()


def noam(step, d_model=256, warmup=10000):
    step = max(step, 1)
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=32, help="utterances per GPU")
    ap.add_argument("--peak-scale", type=float, default=5.0)
    ap.add_argument("--logdir", default="exp/conformer_ctc")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    train_parts = [torchaudio.datasets.LIBRISPEECH(args.root, url=u, download=False)
                   for u in ("train-clean-100", "train-clean-360", "train-other-500")]
    train_set = torch.utils.data.ConcatDataset(train_parts)
    dev_set = torchaudio.datasets.LIBRISPEECH(args.root, url="dev-clean", download=False)
    dev_part = Subset(dev_set, list(range(rank, len(dev_set), world)))

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              collate_fn=make_collate(Featurizer(train=True)), pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_part, batch_size=32, num_workers=4, collate_fn=make_collate(Featurizer(train=False)))

    model = ConformerCTC().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(0.9, 0.98), weight_decay=1e-3)
    # noam schedule tuned for a global batch of 128 utterances
    scale = args.peak_scale * math.sqrt(args.batch_size * world / 128)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: scale * noam(s))
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    step, best_wer = 0, float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for feats, feat_lens, labels, label_lens in train_loader:
            feats, feat_lens = feats.to(device, non_blocking=True), feat_lens.to(device)
            labels, label_lens = labels.to(device), label_lens.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                log_probs, out_lens = model(feats, feat_lens)
            loss = ctc(log_probs.float().transpose(0, 1), labels, out_lens, label_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} ctc {l.item():.3f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 100:.2f}s/it", flush=True)
                    writer.add_scalar("train/ctc", l.item(), step)
                t0 = time.time()

        wer = evaluate_wer(model.module, dev_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: dev-clean WER {wer * 100:.2f}%", flush=True)
            writer.add_scalar("dev/wer", wer, epoch)
            if wer < best_wer:
                best_wer = wer
                os.makedirs(args.logdir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "wer": wer},
                           os.path.join(args.logdir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
