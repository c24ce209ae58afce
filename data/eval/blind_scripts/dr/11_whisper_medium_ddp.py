"""Whisper-medium fine-tuning for low-resource language ASR (seq2seq CE), with per-language WER on dev.

    torchrun --nproc_per_node=8 11_whisper_medium_ddp.py \
        --manifest_dir data/fleurs_sw --language swahili --exp exp/whisper_medium_sw
"""
import argparse
import json
import os
import time
from collections import defaultdict

import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import WhisperForConditionalGeneration, WhisperProcessor, get_linear_schedule_with_warmup
from transformers.models.whisper.english_normalizer import BasicTextNormalizer
import jiwer


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest_dir", required=True)
    p.add_argument("--language", default="swahili")
    p.add_argument("--exp", required=True)
    p.add_argument("--model", default="openai/whisper-medium")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=6.25e-6)
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--gen_max_len", type=int, default=225)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class ManifestDataset(Dataset):
    def __init__(self, path, processor):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        row = self.rows[idx]
        audio, sr = sf.read(row["audio_filepath"], dtype="float32")
        feats = self.processor.feature_extractor(audio, sampling_rate=sr, return_tensors="pt").input_features[0]
        labels = torch.tensor(self.processor.tokenizer(row["text"]).input_ids, dtype=torch.long)
        return feats, labels, idx


class Collator:
    def __init__(self, start_id):
        self.start_id = start_id

    def __call__(self, batch):
        feats = torch.stack([b[0] for b in batch])
        labels = pad_sequence([b[1] for b in batch], batch_first=True, padding_value=-100)
        if (labels[:, 0] == self.start_id).all():
            labels = labels[:, 1:]
        return feats, labels, torch.tensor([b[2] for b in batch])


@torch.no_grad()
def decode_dev(model, loader, rows, processor, device, args, rank, world):
    model.eval()
    pred_ids, utt_ids = [], []
    for feats, _, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.generate(input_features=feats.to(device), language=args.language,
                                 task="transcribe", max_new_tokens=args.gen_max_len)
        pred_ids.extend(out.cpu())
        utt_ids.append(idx)
    model.train()

    pad_id = processor.tokenizer.pad_token_id
    local_preds = pad_sequence(pred_ids, batch_first=True, padding_value=pad_id).to(device)
    local_ids = torch.cat(utt_ids).to(device)
    all_preds = [torch.zeros_like(local_preds) for _ in range(world)]
    all_ids = [torch.zeros_like(local_ids) for _ in range(world)]
    dist.all_gather(all_preds, local_preds)
    dist.all_gather(all_ids, local_ids)
    if rank != 0:
        return None

    normalizer = BasicTextNormalizer()
    by_gender = defaultdict(lambda: ([], []))
    refs, hyps = [], []
    for preds, ids in zip(all_preds, all_ids):
        texts = processor.batch_decode(preds, skip_special_tokens=True)
        for i, hyp in zip(ids.tolist(), texts):
            ref = normalizer(rows[i]["text"])
            hyp = normalizer(hyp)
            refs.append(ref)
            hyps.append(hyp)
            g = rows[i].get("gender", "unk")
            by_gender[g][0].append(ref)
            by_gender[g][1].append(hyp)
    report = {"wer": jiwer.wer(refs, hyps)}
    for g, (r, h) in by_gender.items():
        report[f"wer_{g}"] = jiwer.wer(r, h)
    return report


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337)

    processor = WhisperProcessor.from_pretrained(args.model, language=args.language, task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(args.model)
    model.config.forced_decoder_ids = None
    model.generation_config.forced_decoder_ids = None
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = ManifestDataset(os.path.join(args.manifest_dir, "train.jsonl"), processor)
    dev_ds = ManifestDataset(os.path.join(args.manifest_dir, "dev.jsonl"), processor)
    collate = Collator(model.module.config.decoder_start_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    dev_idx = list(range(rank, len(dev_ds), world))
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, dev_idx), batch_size=16, collate_fn=collate,
                        num_workers=2)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, eps=1e-6)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup_steps, total)

    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        processor.save_pretrained(args.exp)
    best = None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for feats, labels, _ in train_dl:
            feats = feats.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_features=feats, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        report = decode_dev(model.module, dev_dl, dev_ds.rows, processor, device, args, rank, world)
        if rank == 0:
            print(f"epoch {epoch} dev: " + " ".join(f"{k}={100 * v:.2f}" for k, v in report.items()), flush=True)
            if best is None or report["wer"] < best:
                best = report["wer"]
                model.module.save_pretrained(os.path.join(args.exp, "best"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.exp, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
