# NER on CoNLL-2003 with a transformer encoder + linear tagger (first-subword labelling)
# torchrun --nproc_per_node=4 12_ner_conll_cache.py --data_dir data/conll03 --model_name roberta-base
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from seqeval.metrics import f1_score, classification_report
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)
LABELS = ['O', 'B-PER', 'I-PER', 'B-ORG', 'I-ORG', 'B-LOC', 'I-LOC', 'B-MISC', 'I-MISC']
L2I = {l: i for i, l in enumerate(LABELS)}
IGNORE = -100

parser = argparse.ArgumentParser()
parser.add_argument('--data_dir', default='data/conll03')
parser.add_argument('--model_name', default='roberta-base')
parser.add_argument('--output_dir', default='out/ner_conll')
parser.add_argument('--max_seq_length', type=int, default=256)
parser.add_argument('--batch_size', type=int, default=16)
parser.add_argument('--lr', type=float, default=3e-5)
parser.add_argument('--epochs', type=int, default=5)
parser.add_argument('--warmup_ratio', type=float, default=0.1)
parser.add_argument('--overwrite_cache', action='store_true')
parser.add_argument('--seed', type=int, default=13)
args = parser.parse_args()


def read_conll(path):
    sents, words, tags = [], [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith('-DOCSTART-'):
                if words:
                    sents.append((words, tags))
                    words, tags = [], []
                continue
            parts = line.split()
            words.append(parts[0])
            tags.append(parts[-1])
    if words:
        sents.append((words, tags))
    return sents


def convert(sents, tokenizer, max_len):
    all_ids, all_mask, all_lab = [], [], []
    for words, tags in sents:
        enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_len)
        labels, prev = [], None
        for wid in enc.word_ids():
            if wid is None or wid == prev:
                labels.append(IGNORE)
            else:
                labels.append(L2I[tags[wid]])
            prev = wid
        pad = max_len - len(enc['input_ids'])
        all_ids.append(enc['input_ids'] + [tokenizer.pad_token_id] * pad)
        all_mask.append(enc['attention_mask'] + [0] * pad)
        all_lab.append(labels + [IGNORE] * pad)
    return TensorDataset(torch.tensor(all_ids), torch.tensor(all_mask), torch.tensor(all_lab))


def load_and_cache_examples(tokenizer, split):
    cached = os.path.join(args.data_dir, 'cached_{}_{}_{}'.format(
        split, args.model_name.replace('/', '_'), args.max_seq_length))
    if os.path.exists(cached) and not args.overwrite_cache:
        logger.info('Loading features from cached file %s', cached)
        dataset = torch.load(cached, weights_only=False)
    else:
        logger.info('Creating features from dataset file at %s', args.data_dir)
        sents = read_conll(os.path.join(args.data_dir, f'{split}.txt'))
        dataset = convert(sents, tokenizer, args.max_seq_length)
        logger.info('Saving features into cached file %s', cached)
        torch.save(dataset, cached)
    return dataset


class Tagger(nn.Module):
    def __init__(self, name, n_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(self.encoder.config.hidden_size, n_labels)

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.classifier(self.dropout(h))


def evaluate(model, dataset, device, rank, world):
    # every rank tags its strided share; sequences are gathered to rank 0 for seqeval
    idx = list(range(rank, len(dataset), world))
    loader = DataLoader(torch.utils.data.Subset(dataset, idx), batch_size=64)
    model.eval()
    true_seqs, pred_seqs = [], []
    with torch.no_grad():
        for ids, mask, lab in loader:
            logits = model(ids.to(device), mask.to(device))
            pred = logits.argmax(-1).cpu()
            for p, l in zip(pred, lab):
                keep = l != IGNORE
                true_seqs.append([LABELS[i] for i in l[keep].tolist()])
                pred_seqs.append([LABELS[i] for i in p[keep].tolist()])
    model.train()
    out = [None] * world
    dist.all_gather_object(out, (true_seqs, pred_seqs))
    if rank != 0:
        return None, None
    y_true = [s for t, _ in out for s in t]
    y_pred = [s for _, p in out for s in p]
    return f1_score(y_true, y_pred), classification_report(y_true, y_pred, digits=4)


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    logging.basicConfig(format='%(asctime)s %(levelname)s %(message)s',
                        level=logging.INFO if rank == 0 else logging.WARN)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name, add_prefix_space=True)
    train_ds = load_and_cache_examples(tokenizer, 'train')
    dev_ds = load_and_cache_examples(tokenizer, 'valid')
    test_ds = load_and_cache_examples(tokenizer, 'test')

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, pin_memory=True)

    model = Tagger(args.model_name, len(LABELS)).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    no_decay = ['bias', 'LayerNorm.weight']
    params = [
        {'params': [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], 'weight_decay': 0.01},
        {'params': [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], 'weight_decay': 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    t_total = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * t_total), t_total)
    loss_fct = nn.CrossEntropyLoss(ignore_index=IGNORE)

    tb = SummaryWriter(os.path.join(args.output_dir, 'runs')) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info('num examples %d, world %d, total steps %d', len(train_ds), world, t_total)

    best_f1, global_step = -1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for ids, mask, lab in train_dl:
            ids, mask, lab = ids.to(device), mask.to(device), lab.to(device)
            logits = model(ids, mask)
            loss = loss_fct(logits.view(-1, len(LABELS)), lab.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1
            if tb is not None and global_step % 50 == 0:
                tb.add_scalar('loss', loss.item(), global_step)
                tb.add_scalar('lr', scheduler.get_last_lr()[0], global_step)

        f1, _ = evaluate(model.module, dev_ds, device, rank, world)
        if rank == 0:
            logger.info('epoch %d dev F1 %.4f (%.0fs)', epoch, f1, time.time() - start)
            tb.add_scalar('dev_f1', f1, epoch)
            if f1 > best_f1:
                best_f1 = f1
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, 'best.bin'))
                tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    # test with the best dev checkpoint
    model.module.load_state_dict(torch.load(os.path.join(args.output_dir, 'best.bin'), map_location=device))
    f1, report = evaluate(model.module, test_ds, device, rank, world)
    if rank == 0:
        logger.info('test F1 %.4f\n%s', f1, report)
        tb.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
