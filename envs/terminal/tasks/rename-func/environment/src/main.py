from data import get_data, get_data_size

print(sorted(get_data()), get_data_size())
