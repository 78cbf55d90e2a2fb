def get_data():
    return [3, 1, 2]


def get_data_size():
    return len(get_data())
