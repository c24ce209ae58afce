"""CTC fine-tuning of torchaudio's wav2vec2 BASE bundle with dynamic (frame-budget) batching.

Each rank draws its own share of the shuffled utterances and packs them into
batches of at most --max_frames audio samples, so short utterances go in big
batches and long ones in small batches.

    torchrun --nproc_per_node=4 15_torchaudio_w2v2_dynamic_batch.py --manifest_dir data/ls100
"""
import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

LABELS = ("-", "|", "E", "T", "A", "O", "N", "I", "H", "S", "R", "D", "L", "U", "M", "W", "C", "F",
          "G", "Y", "P", "B", "V", "K", "'", "X", "J", "Q", "Z")
CHAR2ID = {c: i for i, c in enumerate(LABELS)}


class TsvAudio(Dataset):
    def __init__(self, path):
        self.rows = []
        for line in open(path):
            wav, n, text = line.rstrip("\n").split("\t")
            self.rows.append((wav, int(n), text.upper()))
        self.lengths = [n for _, n, _ in self.rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        wav, _, text = self.rows[i]
        audio, sr = torchaudio.load(wav)
        assert sr == 16000
        target = torch.tensor([CHAR2ID[c] for c in text.replace(" ", "|") if c in CHAR2ID])
        return audio[0], target, text


def collate(batch):
    audio, tgt, text = zip(*batch)
    return (torch.nn.utils.rnn.pad_sequence(audio, batch_first=True),
            torch.tensor([a.numel() for a in audio]),
            torch.cat(tgt), torch.tensor([t.numel() for t in tgt]), list(text))


class DistributedDynamicBatchSampler:
    def __init__(self, lengths, max_frames, num_replicas, rank, shuffle=True, seed=0):
        self.lengths = lengths
        self.max_frames = max_frames
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _pack(self, indices):
        indices = sorted(indices, key=lambda i: self.lengths[i])
        batches, cur, longest = [], [], 0
        for i in indices:
            longest_if_added = max(longest, self.lengths[i])
            if cur and longest_if_added * (len(cur) + 1) > self.max_frames:
                batches.append(cur)
                cur, longest_if_added = [], self.lengths[i]
            cur.append(i)
            longest = longest_if_added
        if cur:
            batches.append(cur)
        return batches

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self.shuffle:
            perm = torch.randperm(len(self.lengths), generator=g).tolist()
        else:
            perm = list(range(len(self.lengths)))
        mine = perm[self.rank::self.num_replicas]
        batches = self._pack(mine)
        if self.shuffle:
            order = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[j] for j in order]
        return iter(batches)

    def __len__(self):
        return math.ceil(sum(self.lengths) / self.num_replicas / self.max_frames)


def build_model(num_labels):
    model = torchaudio.models.wav2vec2_base(aux_num_out=num_labels, encoder_layer_drop=0.0)
    pretrained = torchaudio.pipelines.WAV2VEC2_BASE.get_model().state_dict()
    missing, unexpected = model.load_state_dict(pretrained, strict=False)
    assert all(k.startswith("aux.") for k in missing), missing
    model.feature_extractor.requires_grad_(False)
    return model


def greedy(emissions, lengths):
    out = []
    for em, n in zip(emissions.argmax(-1), lengths):
        ids = torch.unique_consecutive(em[: int(n)]).tolist()
        out.append("".join(LABELS[i] for i in ids if i != 0).replace("|", " ").strip())
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for wav, wl, _, _, text in loader:
        em, ol = model(wav.to(device), wl.to(device))
        for h, r in zip(greedy(em, ol), text):
            c[0] += torchaudio.functional.edit_distance(r.split(), h.split())
            c[1] += len(r.split())
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest_dir", default="data/ls100")
    ap.add_argument("--out", default="exp/ta_w2v2_base_ls100")
    ap.add_argument("--max_frames", type=int, default=16000 * 200)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--freeze_encoder_epochs", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    log = logging.getLogger()

    train = TsvAudio(os.path.join(args.manifest_dir, "train.tsv"))
    dev = TsvAudio(os.path.join(args.manifest_dir, "dev_clean.tsv"))
    train_bs = DistributedDynamicBatchSampler(train.lengths, args.max_frames, world, rank, seed=3)
    dev_bs = DistributedDynamicBatchSampler(dev.lengths, args.max_frames, world, rank, shuffle=False)
    train_dl = DataLoader(train, batch_sampler=train_bs, collate_fn=collate, num_workers=6, pin_memory=True)
    dev_dl = DataLoader(dev, batch_sampler=dev_bs, collate_fn=collate, num_workers=2)

    model = DDP(build_model(len(LABELS)).to(device), device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0)
    total = args.epochs * len(train_bs)
    warmup = int(0.1 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else max(0.05, (total - s) / (total - warmup)))
    ctc = torch.nn.CTCLoss(blank=0, zero_infinity=True)

    os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_bs.set_epoch(epoch)
        model.train()
        seen = 0
        for wav, wl, tgt, tl, _ in train_dl:
            wav, wl = wav.to(device, non_blocking=True), wl.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                em, ol = model(wav, wl)
            lp = em.float().log_softmax(-1).transpose(0, 1)
            loss = ctc(lp, tgt.to(device), ol, tl.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 10.0)
            opt.step()
            sched.step()
            seen += 1
            if seen % 100 == 0:
                log.info("epoch %d batch %d loss %.3f lr %.2e", epoch, seen, loss.item(), sched.get_last_lr()[0])

        wer = evaluate(model.module, dev_dl, device)
        log.info("epoch %d dev-clean WER %.2f%%", epoch, 100 * wer)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pt"))
            if wer < best:
                best = wer
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
