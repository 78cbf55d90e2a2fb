printf 'first line  \r\n\tindented\t\r\nmiddle   spaces kept \r\n\r\nlast\r\n' > notes.txt
