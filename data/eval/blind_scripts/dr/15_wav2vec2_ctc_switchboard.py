"""wav2vec2-base CTC on Switchboard (300h) -> evaluate best checkpoint on Hub5'00 (SWB + CH).

    torchrun --nproc_per_node=4 15_wav2vec2_ctc_switchboard.py \
        --data data/swbd --processor data/swbd/processor --exp exp/w2v2_base_swbd
Expects <data>/{train,dev,eval2000_swb,eval2000_ch}.jsonl.
"""
import argparse
import json
import logging
import os
import time

import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC, Wav2Vec2Processor, get_linear_schedule_with_warmup
import jiwer

logger = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--processor", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--pretrained", default="facebook/wav2vec2-base")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--patience", type=int, default=5)
    return ap.parse_args()


def read_split(data_dir, name, max_sec=None):
    with open(os.path.join(data_dir, f"{name}.jsonl")) as f:
        rows = [json.loads(l) for l in f]
    if max_sec:
        rows = [r for r in rows if r["duration"] <= max_sec]
    return rows


class SwbdSet(Dataset):
    def __init__(self, rows, processor):
        self.rows, self.processor = rows, processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = sf.read(r["audio_filepath"], dtype="float32")
        x = self.processor(wav, sampling_rate=sr).input_values[0]
        y = self.processor.tokenizer(r["text"]).input_ids
        return {"x": x, "y": y, "ref": r["text"]}


class Collate:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, items):
        enc = self.processor.feature_extractor.pad({"input_values": [it["x"] for it in items]},
                                                   return_attention_mask=True, return_tensors="pt")
        ylen = max(len(it["y"]) for it in items)
        labels = torch.full((len(items), ylen), -100, dtype=torch.long)
        for k, it in enumerate(items):
            labels[k, : len(it["y"])] = torch.tensor(it["y"])
        return {"input_values": enc["input_values"], "attention_mask": enc["attention_mask"],
                "labels": labels}, [it["ref"] for it in items]


def make_eval_loader(rows, processor, rank, world):
    rows = sorted(rows, key=lambda r: r["duration"])[rank::world]
    return DataLoader(SwbdSet(rows, processor), batch_size=16, collate_fn=Collate(processor), num_workers=2)


@torch.no_grad()
def score(model, loader, processor, device):
    model.eval()
    c = torch.zeros(2, dtype=torch.float64, device=device)
    for batch, refs in loader:
        logits = model(input_values=batch["input_values"].to(device),
                       attention_mask=batch["attention_mask"].to(device)).logits
        hyps = processor.batch_decode(logits.argmax(-1))
        for ref, hyp in zip(refs, hyps):
            if not ref.strip():
                continue
            o = jiwer.process_words(ref, hyp)
            c[0] += o.substitutions + o.deletions + o.insertions
            c[1] += len(ref.split())
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def train_one_epoch(model, loader, optimizer, scheduler, device, epoch):
    model.train()
    t0 = time.time()
    for it, (batch, _) in enumerate(loader):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if it % 100 == 0:
            logger.info("epoch %d iter %d/%d loss %.4f (%.0fs)", epoch, it, len(loader), loss.item(), time.time() - t0)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(11)

    processor = Wav2Vec2Processor.from_pretrained(args.processor)
    train_rows = read_split(args.data, "train", max_sec=15.0)
    train_set = SwbdSet(train_rows, processor)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=Collate(processor), num_workers=6, pin_memory=True, drop_last=True)
    dev_loader = make_eval_loader(read_split(args.data, "dev"), processor, rank, world)

    config = Wav2Vec2Config.from_pretrained(
        args.pretrained, vocab_size=len(processor.tokenizer), pad_token_id=processor.tokenizer.pad_token_id,
        ctc_loss_reduction="mean", ctc_zero_infinity=True, mask_time_prob=0.05, layerdrop=0.0,
    )
    model = Wav2Vec2ForCTC.from_pretrained(args.pretrained, config=config)
    model.freeze_feature_encoder()
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.005)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, args.epochs * len(train_loader))

    best_path = os.path.join(args.exp, "best_model.pt")
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        config.save_pretrained(args.exp)
        processor.save_pretrained(args.exp)

    best_wer, bad_epochs = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, optimizer, scheduler, device, epoch)
        wer = score(model.module, dev_loader, processor, device)
        logger.info("epoch %d dev WER %.2f%%", epoch, 100 * wer)
        if wer < best_wer:
            best_wer, bad_epochs = wer, 0
            if rank == 0:
                torch.save(model.state_dict(), best_path)
                logger.info("saved %s", best_path)
        else:
            bad_epochs += 1
        dist.barrier()
        if bad_epochs >= args.patience:
            logger.info("no improvement for %d epochs, stopping", bad_epochs)
            break

    # ---- final scoring of the best checkpoint on Hub5'00 ----
    del model, optimizer
    torch.cuda.empty_cache()
    best = Wav2Vec2ForCTC(config)
    best.load_state_dict(torch.load(best_path, map_location="cpu"))
    best.to(device)
    for subset in ("eval2000_swb", "eval2000_ch"):
        loader = make_eval_loader(read_split(args.data, subset), processor, rank, world)
        wer = score(best, loader, processor, device)
        logger.info("best checkpoint (dev WER %.2f%%): %s WER %.2f%%", 100 * best_wer, subset, 100 * wer)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
