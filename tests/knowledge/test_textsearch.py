from assistant.knowledge.textsearch import fts_query, search_tokens


def test_chinese_becomes_bigrams_that_match_inside_longer_text():
    query = set(search_tokens("找不到设备"))
    doc = set(search_tokens("DDP一直报错找不到设备了，求指点"))
    assert query == {"找不", "不到", "到设", "设备"}
    assert query <= doc


def test_identifiers_split_and_stopwords_dropped():
    assert search_tokens("The init_process_group call") == ["init", "process", "group", "call"]


def test_query_quotes_tokens_and_handles_empty():
    assert fts_query("nccl NCCL timeout") == '"nccl" OR "timeout"'
    assert fts_query("nccl timeout gloo", {"gloo": 1, "nccl": 9}) == '"gloo" OR "nccl"'
    assert fts_query("!!! ...") is None


def test_terms_common_to_a_large_index_are_dropped():
    df = {"gpu": 5000, "duplicate": 12, "rank": 900}
    assert fts_query("duplicate gpu rank", df, max_df=1000) == '"duplicate" OR "rank"'
    assert fts_query("gpu", df, max_df=1000) is None
