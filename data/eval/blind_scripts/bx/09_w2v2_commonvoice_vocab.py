"""Fine-tune wav2vec2-base on a Common Voice language with a character vocabulary
built from the transcripts (follows the HF "fine-tune XLSR" blog recipe, ported to
plain DDP so it can run on our 4-GPU boxes).
"""
import argparse
import json
import os
import re

import pandas as pd
import torch
import torch.distributed as dist
import torchaudio
from jiwer import wer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import Wav2Vec2ForCTC, get_linear_schedule_with_warmup

CHARS_TO_REMOVE = r'[\,\?\.\!\-\;\:\"\“\%\‘\”\�\']'


def remove_special_characters(text):
    return re.sub(CHARS_TO_REMOVE, "", text).lower().strip()


def extract_all_chars(texts):
    all_text = " ".join(texts)
    return list(set(all_text))


def build_vocab(train_texts, test_texts):
    vocab_list = list(set(extract_all_chars(train_texts)) | set(extract_all_chars(test_texts)))
    vocab_dict = {v: k for k, v in enumerate(vocab_list)}
    vocab_dict["|"] = vocab_dict[" "]
    del vocab_dict[" "]
    vocab_dict["[UNK]"] = len(vocab_dict)
    vocab_dict["[PAD]"] = len(vocab_dict)
    return vocab_dict


class CharTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab
        self.inv = {i: c for c, i in vocab.items()}
        self.pad_id = vocab["[PAD]"]
        self.unk_id = vocab["[UNK]"]

    def encode(self, text):
        return [self.vocab.get(c, self.unk_id) for c in text.replace(" ", "|")]

    def decode_ctc(self, ids):
        out, prev = [], None
        for i in ids:
            if i != prev and i != self.pad_id:
                out.append(self.inv.get(i, ""))
            prev = i
        return "".join(out).replace("[UNK]", "").replace("|", " ").strip()


class CommonVoice(Dataset):
    def __init__(self, df, clips_dir, tokenizer):
        self.paths = df["path"].tolist()
        self.texts = df["sentence"].tolist()
        self.clips_dir = clips_dir
        self.tok = tokenizer
        self.resampler = torchaudio.transforms.Resample(48000, 16000)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(os.path.join(self.clips_dir, self.paths[i]))
        wav = self.resampler(wav) if sr == 48000 else torchaudio.functional.resample(wav, sr, 16000)
        wav = wav.mean(0)
        wav = (wav - wav.mean()) / (wav.std() + 1e-7)
        return wav, torch.tensor(self.tok.encode(self.texts[i])), self.texts[i]


def make_collate(pad_id):
    def collate(batch):
        wavs, labels, texts = zip(*batch)
        x = torch.nn.utils.rnn.pad_sequence(wavs, batch_first=True)
        y = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)
        return x, y, list(texts)
    return collate


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cv_dir", default="/data/cv-corpus-15.0/tr")
    parser.add_argument("--output_dir", default="./wav2vec2-base-tr")
    parser.add_argument("--model", default="facebook/wav2vec2-base")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--max_duration", type=float, default=8.0)
    parser.add_argument("--eval_every", type=int, default=2)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_df = pd.read_csv(os.path.join(args.cv_dir, "train.tsv"), sep="\t", quoting=3)
    test_df = pd.read_csv(os.path.join(args.cv_dir, "test.tsv"), sep="\t", quoting=3)
    train_df["sentence"] = train_df["sentence"].astype(str).map(remove_special_characters)
    test_df["sentence"] = test_df["sentence"].astype(str).map(remove_special_characters)

    vocab_dict = build_vocab(train_df["sentence"], test_df["sentence"])
    tokenizer = CharTokenizer(vocab_dict)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "vocab.json"), "w") as f:
            json.dump(vocab_dict, f, ensure_ascii=False)

    clips = os.path.join(args.cv_dir, "clips")
    train_set = CommonVoice(train_df, clips, tokenizer)
    test_set = CommonVoice(test_df, clips, tokenizer)
    collate = make_collate(tokenizer.pad_id)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    test_subset = torch.utils.data.Subset(test_set, range(rank, len(test_set), world_size))
    test_loader = DataLoader(test_subset, batch_size=args.batch_size, collate_fn=collate, num_workers=4)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.model,
        ctc_loss_reduction="mean",
        pad_token_id=tokenizer.pad_id,
        vocab_size=len(vocab_dict),
        attention_dropout=0.1,
        hidden_dropout=0.1,
        feat_proj_dropout=0.0,
        mask_time_prob=0.05,
        layerdrop=0.0,
    )
    model.freeze_feature_encoder()
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps,
                                                len(train_loader) * args.epochs)
    scaler = torch.cuda.amp.GradScaler()

    best_wer = 1e9
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (x, y, _) in enumerate(train_loader):
            x, y = x.to(device), y.to(device)
            with torch.cuda.amp.autocast():
                loss = model(x, labels=y).loss
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}")

        if (epoch + 1) % args.eval_every:
            continue
        model.eval()
        preds, refs = [], []
        with torch.no_grad():
            for x, _, texts in test_loader:
                logits = model.module(x.to(device)).logits
                for ids in logits.argmax(-1).tolist():
                    preds.append(tokenizer.decode_ctc(ids))
                refs.extend(texts)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (preds, refs))
        if rank == 0:
            all_preds = sum((g[0] for g in gathered), [])
            all_refs = sum((g[1] for g in gathered), [])
            score = wer(all_refs, all_preds)
            print(f"epoch {epoch}: test WER {score:.4f}")
            if score < best_wer:
                best_wer = score
                model.module.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
