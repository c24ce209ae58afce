"""Whisper-base fine-tuning on short voice-command utterances (seq2seq CE), WER on held-out speakers.

    torchrun --nproc_per_node=4 19_whisper_base_ddp.py --train_list lists/train.lst \
        --test_list lists/test.lst --save_dir exp/whisper_base_cmds

List format: wav_path|transcript
"""
import argparse
import os
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import WhisperForConditionalGeneration, WhisperProcessor
from transformers.optimization import get_constant_schedule_with_warmup
from transformers.models.whisper.english_normalizer import BasicTextNormalizer
import jiwer


def build_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_list", required=True)
    parser.add_argument("--test_list", required=True)
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--model_name", default="openai/whisper-base")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--noise_prob", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def read_list(path):
    with open(path, encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("|", 1)) for line in f if "|" in line]


class CommandSet(Dataset):
    def __init__(self, items, processor, noise_prob=0.0):
        self.items = items
        self.processor = processor
        self.noise_prob = noise_prob

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, text = self.items[i]
        audio, sr = sf.read(path, dtype="float32")
        if self.noise_prob and np.random.rand() < self.noise_prob:
            snr_db = np.random.uniform(5, 25)
            noise = np.random.randn(len(audio)).astype(np.float32)
            scale = np.sqrt((audio ** 2).mean() / (10 ** (snr_db / 10)) + 1e-10)
            audio = audio + scale * noise
        feats = self.processor.feature_extractor(audio, sampling_rate=sr, return_tensors="pt").input_features[0]
        ids = self.processor.tokenizer(text).input_ids
        return feats, ids, text


def make_collate(decoder_start_token_id):
    def collate(batch):
        feats = torch.stack([b[0] for b in batch])
        lens = [len(b[1]) for b in batch]
        labels = torch.full((len(batch), max(lens)), -100, dtype=torch.long)
        for i, b in enumerate(batch):
            labels[i, : lens[i]] = torch.tensor(b[1])
        if (labels[:, 0] == decoder_start_token_id).all():
            labels = labels[:, 1:]
        return feats, labels, [b[2] for b in batch]
    return collate


def worker_init(worker_id):
    info = torch.utils.data.get_worker_info()
    np.random.seed((info.seed + worker_id) % 2 ** 32)


@torch.no_grad()
def test_wer(model, loader, processor, device, normalizer):
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for feats, _, refs in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model.generate(input_features=feats.to(device), language="en", task="transcribe",
                                 max_new_tokens=64)
        for ref, hyp in zip(refs, processor.batch_decode(out, skip_special_tokens=True)):
            ref, hyp = normalizer(ref), normalizer(hyp)
            if not ref:
                continue
            m = jiwer.process_words(ref, hyp)
            counts += torch.tensor([m.substitutions + m.deletions + m.insertions, len(ref.split())],
                                   dtype=torch.float64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    model.train()
    return (counts[0] / counts[1]).item()


def main():
    args = build_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    # different augmentation noise per rank; DDP broadcasts rank 0's weights anyway
    torch.manual_seed(args.seed + rank)

    processor = WhisperProcessor.from_pretrained(args.model_name, language="english", task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(args.model_name)
    model.config.forced_decoder_ids = None
    model.generation_config.forced_decoder_ids = None
    model.cuda(args.local_rank)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    collate = make_collate(model.module.config.decoder_start_token_id)
    train_set = CommandSet(read_list(args.train_list), processor, noise_prob=args.noise_prob)
    test_items = read_list(args.test_list)
    test_set = CommandSet(test_items[rank::world_size], processor)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=8, pin_memory=True, drop_last=True, worker_init_fn=worker_init)
    test_loader = DataLoader(test_set, batch_size=64, collate_fn=collate, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = get_constant_schedule_with_warmup(optimizer, args.warmup)
    scaler = torch.cuda.amp.GradScaler()
    normalizer = BasicTextNormalizer()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        processor.save_pretrained(args.save_dir)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        loss_sum = torch.zeros((), device=device)
        for step, (feats, labels, _) in enumerate(train_loader):
            feats, labels = feats.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(input_features=feats, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum += loss.detach()

        dist.all_reduce(loss_sum)
        mean_loss = loss_sum.item() / (world_size * max(1, len(train_loader)))
        wer = test_wer(model.module, test_loader, processor, device, normalizer)
        if rank == 0:
            print(f"epoch {epoch}: train loss {mean_loss:.4f} | test WER {100 * wer:.2f}% | "
                  f"{time.time() - start:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.save_dir, "last.pt"))
            if wer < best:
                best = wer
                model.module.save_pretrained(os.path.join(args.save_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
